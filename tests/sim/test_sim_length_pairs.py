"""The joint (prompt, output) length sampler with vLLM's ShareGPT limits (`workload.lengths`)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servetwin.core.config_error import ConfigError
from servetwin.sim.length_pairs import parse_joint_lengths
from servetwin.sim.workload import build_workload


def _sharegpt(**limits):
    return {"type": "sharegpt_like", "prompt": {"type": "lognormal", "mean": 400, "cv": 1.5},
            "output": {"type": "lognormal", "mean": 300, "cv": 1.5}, **limits}


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 300), min_tokens=st.integers(1, 20),
       max_prompt=st.one_of(st.none(), st.integers(20, 3000)), max_total=st.one_of(st.none(), st.integers(40, 5000)),
       fixed_output=st.booleans())
def test_every_drawn_pair_meets_the_limits(seed, n, min_tokens, max_prompt, max_total, fixed_output):
    cfg = _sharegpt(min_tokens=min_tokens, max_prompt_tokens=max_prompt, max_total_tokens=max_total)
    if fixed_output:
        cfg["output"] = 2  # vLLM skips the minimum check for a fixed output length
    sampler = parse_joint_lengths(cfg)
    try:
        p, o = sampler.sample(np.random.default_rng(seed), n)
    except ConfigError:  # only when the limits really accept almost nothing (< 1% allowed)
        p, o = sampler.source.draw(np.random.default_rng(seed + 1), 100_000)
        assert sampler.limits.valid(p, o).mean() < 0.02
        return
    assert len(p) == len(o) == n
    assert (p >= min_tokens).all()
    assert (o >= (1 if fixed_output else min_tokens)).all()
    if max_prompt is not None:
        assert (p <= max_prompt).all()
    if max_total is not None:
        assert (p + o <= max_total).all()


def test_the_defaults_are_vllms_and_rejected_pairs_are_drawn_again():
    sampler = parse_joint_lengths(_sharegpt())
    lim = sampler.limits
    assert (lim.min_tokens, lim.max_prompt_tokens, lim.max_total_tokens) == (4, 1024, 2048)
    p, o = sampler.sample(np.random.default_rng(0), 20_000)
    assert p.max() <= 1024 and (p + o).max() <= 2048 and min(p.min(), o.min()) >= 4
    # the prompts lognormal (mean 400, cv 1.5) puts ~8% above 1024: rejected, not clipped to 1024
    assert (p == 1024).sum() < 20
    raw = sampler.source.draw(np.random.default_rng(0), 20_000)[0]
    assert (raw > 1024).mean() > 0.05


def test_same_seed_same_pairs_other_seed_other_pairs():
    cfg = {"requests": 50, "seed": 3, "lengths": _sharegpt()}
    _, a = build_workload(cfg, vocab_size=1000)
    _, b = build_workload(cfg, vocab_size=1000)
    _, c = build_workload({**cfg, "seed": 4}, vocab_size=1000)
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    assert [r.max_tokens for r in a] == [r.max_tokens for r in b]
    assert [len(r.prompt_token_ids) for r in a] != [len(r.prompt_token_ids) for r in c]
    assert all(len(r.prompt_token_ids) + r.max_tokens <= 2048 for r in a)


def test_empirical_pairs_file_with_header_and_inline_pairs(tmp_path):
    f = tmp_path / "pairs.csv"
    f.write_text("prompt_tokens,output_tokens\n# comment\n100, 50\n2000 10\n3\t40\n500,1600\n")
    sampler = parse_joint_lengths({"type": "empirical", "path": str(f)})
    p, o = sampler.sample(np.random.default_rng(1), 200)
    # 2000 > 1024, 3 < 4 and 500 + 1600 > 2048 are rejected: only (100, 50) remains
    assert set(zip(p.tolist(), o.tolist())) == {(100, 50)}
    inline = parse_joint_lengths({"type": "empirical", "pairs": [[10, 20], [30, 40]], "max_total_tokens": None})
    p, o = inline.sample(np.random.default_rng(1), 100)
    assert set(zip(p.tolist(), o.tolist())) == {(10, 20), (30, 40)}


@pytest.mark.parametrize("cfg, field", [
    ({"type": "sharegpt"}, "workload.lengths.type"),
    ({"type": "sharegpt_like", "prompt": 10}, "workload.lengths.output"),
    ({**_sharegpt(), "max_prompt": 3}, "workload.lengths.max_prompt"),
    ({**_sharegpt(), "min_tokens": 0}, "workload.lengths.min_tokens"),
    ({**_sharegpt(), "max_prompt_tokens": 2}, "workload.lengths.max_prompt_tokens"),
    ({**_sharegpt(), "max_total_tokens": 7}, "workload.lengths.max_total_tokens"),
    ({"type": "empirical"}, "workload.lengths"),
    ({"type": "empirical", "pairs": [[1, 2, 3]]}, "workload.lengths.pairs[0]"),
    ({"type": "empirical", "path": "/nonexistent/pairs.csv"}, "workload.lengths.path"),
])
def test_bad_fields_are_named(cfg, field):
    with pytest.raises(ConfigError) as e:
        parse_joint_lengths(cfg)
    assert e.value.path == field


def test_bad_pairs_file_line_is_named(tmp_path):
    f = tmp_path / "pairs.csv"
    f.write_text("10,20\n30\n")
    with pytest.raises(ConfigError, match=r"pairs.csv:2.*two integer lengths"):
        parse_joint_lengths({"type": "empirical", "path": str(f)})


def test_limits_that_reject_nearly_everything_are_an_error_not_a_hang():
    cfg = {"type": "sharegpt_like", "prompt": {"type": "uniform", "low": 5000, "high": 9000}, "output": 100}
    with pytest.raises(ConfigError) as e:
        parse_joint_lengths(cfg).sample(np.random.default_rng(0), 10)
    assert e.value.path == "workload.lengths"
    assert "accepted 0 of" in e.value.message and "prompt > max_prompt_tokens: 100.0%" in e.value.message


@pytest.mark.parametrize("key", ["prompt_tokens", "output_tokens", "max_prompt_tokens", "shared_prefix"])
def test_lengths_replaces_the_independent_lengths(key):
    value = {"groups": 1, "per_group": 2, "prefix_tokens": 4} if key == "shared_prefix" else 10
    with pytest.raises(ConfigError) as e:
        build_workload({"requests": 2, "lengths": _sharegpt(), key: value})
    assert e.value.path == f"workload.{key}"
