"""benchmarks/published_cluster/calibrate_prefill.py: llm-d's calibrate.sh replayed on the simulated gpt-oss-120b
deployments of the routing and P/D cases gives, with the presets as they are, the peakPrefillThroughput llm-d
published for each (39,065 tok/s on H100 TP1, 33,821 through the P/D path on H200): the Triton MoE kernel's
one fitted rate (sim/gpu_calibration.py, TRITON_MXFP4_COMPUTE) was fitted on these two figures together."""
from __future__ import annotations

import math

import pytest
from inttest_helpers import load_benchmark


def test_the_presets_reproduce_both_published_calibrations():
    script = load_benchmark("published_cluster/calibrate_prefill")
    errors = script.log_errors(None)
    assert set(errors) == set(script.ANCHORS)
    for case, e in errors.items():
        assert abs(math.expm1(e)) < 0.03, case
    # the fraction moves the measurement the right way: a slower kernel measures a lower throughput
    h100 = "routing_gptoss120b_h100_16xtp1_rr"
    now = script.ANCHORS[h100] * math.exp(errors[h100])
    assert now == pytest.approx(39_440, rel=0.01)
    assert script.measured_peak_prefill_throughput(h100, 0.5) < now
