"""The simulator's speculative-decoding acceptance model: draws, fits and the sourced defaults."""
from __future__ import annotations

import pytest

from servetwin.core.config_error import ConfigError
from servetwin.core.sched.spec_decode import SpecDecodingStats
from servetwin.sim.spec_acceptance import DEFAULT_ACCEPTANCE, AcceptanceModel, constant_rate_for


def test_draws_are_prefixes_with_the_modelled_frequencies():
    model = AcceptanceModel((0.8, 0.5), seed=7)
    counts = [model.num_accepted(f"r{i}", i % 13, 3) for i in range(20000)]
    assert all(0 <= a <= 3 for a in counts)
    n = len(counts)
    assert abs(sum(a >= 1 for a in counts) / n - 0.8) < 0.02
    assert abs(sum(a >= 2 for a in counts) / n - 0.4) < 0.02
    assert abs(sum(a >= 3 for a in counts) / n - 0.2) < 0.02
    assert abs(sum(counts) / n - model.expected_accepted(3)) < 0.03
    assert model.num_accepted("r5", 5, 3) == model.num_accepted("r5", 5, 3)  # deterministic


def test_fit_from_vllm_metrics_recovers_the_rates():
    truth = AcceptanceModel((0.9, 0.7, 0.6), seed=3)
    stats = SpecDecodingStats.new(3)
    for i in range(20000):
        stats.observe_draft(3, truth.num_accepted(f"q{i}", i, 3))
    fitted = AcceptanceModel.from_spec_decode_metrics(stats.num_drafts, stats.num_accepted_tokens_per_pos)
    for got, want in zip(fitted.rates, truth.rates):
        assert abs(got - want) < 0.02
    with pytest.raises(ConfigError, match=r"num_accepted_tokens_per_pos\[1\]"):
        AcceptanceModel.from_spec_decode_metrics(10, [5, 6])
    with pytest.raises(ConfigError, match=r"rates\[0\]"):
        AcceptanceModel((1.5,))


def test_defaults_reproduce_their_published_figures():
    # DeepSeek-V3 report: second token accepted 85-90%; original V3-0324 MTP module: tau 3.20 at K=7
    mtp = DEFAULT_ACCEPTANCE["mtp"]
    assert 0.85 <= mtp.rates[0] <= 0.90
    assert abs(mtp.mean_acceptance_length(7) - 3.20) < 0.01
    # public EAGLE-3 head for Llama-3.1-8B: tau 2.77 at K=7 (MT-bench, temperature 1)
    assert abs(DEFAULT_ACCEPTANCE["eagle3"].mean_acceptance_length(7) - 2.77) < 0.01
    assert abs(constant_rate_for(2.77, 7) - DEFAULT_ACCEPTANCE["eagle3"].rates[0]) < 0.001
    assert abs(constant_rate_for(3.20, 7, first=0.875) - mtp.rates[1]) < 0.001
    assert DEFAULT_ACCEPTANCE["ngram"].mean_acceptance_length(3) == 1.875
