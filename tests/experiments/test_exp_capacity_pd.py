"""`servetwin capacity` over prefill/decode deployments: P:D ratios and TP per role next to aggregated ones."""
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from servetwin.experiments.capacity.deployments import ProbeCache, aggregated_template
from servetwin.experiments.capacity.deployments_cli import DeploymentSpace, search_space
from servetwin.experiments.capacity.pd_deployments import cheapest_counts, pd_templates, search_pd


def _staircase_probe(need_decode: list[int]):
    """Meets the SLOs iff decode >= need_decode[prefill - 1] (non-increasing: monotone in both counts)."""
    calls = []

    def evaluate(counts):
        p, d = counts
        calls.append(counts)
        ratio = need_decode[p - 1] / d
        return [{"name": "ttft_p99_s", "limit": 2.0, "value": 2.0 * ratio, "met": ratio <= 1.0, "ratio": ratio}]
    return ProbeCache(lambda p, d: (p, d), evaluate, lambda p, d: f"{p}:{d}", lambda msg: None), calls


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(st.integers(1, 13), min_size=1, max_size=10), max_decode=st.integers(1, 12),
       prefill_tp=st.sampled_from([1, 2, 4]), decode_tp=st.sampled_from([1, 2, 4, 8]))
def test_the_pd_search_finds_the_fewest_gpus_of_any_monotone_frontier(steps, max_decode, prefill_tp, decode_tp):
    need = sorted(steps, reverse=True)  # fewer decode instances needed with more prefill instances
    max_prefill = len(need)
    probe, calls = _staircase_probe(need)
    found = cheapest_counts(probe, prefill_tp, decode_tp, max_prefill, max_decode)
    meeting = [(p, d) for p, d in itertools.product(range(1, max_prefill + 1), range(1, max_decode + 1))
               if d >= need[p - 1]]
    cost = lambda c: c[0] * prefill_tp + c[1] * decode_tp  # noqa: E731
    if not meeting:
        assert found is None
        assert len(calls) == 1  # only the largest deployment was tried
    else:
        assert found in meeting
        assert cost(found) == min(cost(c) for c in meeting)  # brute force over every P:D ratio
        # bisection per role, then at most one probe (and a bisection) per larger prefill count
        assert len(calls) <= 1 + 2 * (max_prefill.bit_length() + max_decode.bit_length()) * max_prefill
    assert len(calls) == len(set(calls))  # no deployment simulated twice


def _role_probe(min_prefill: int, min_decode: int):
    """TTFT misses below min_prefill prefill instances, TPOT below min_decode decode instances."""
    def evaluate(counts):
        p, d = counts
        ttft, tpot = min_prefill / p, min_decode / d
        return [{"name": "ttft_p99_s", "limit": 2.0, "value": 2.0 * ttft, "met": ttft <= 1.0, "ratio": ttft},
                {"name": "tpot_p99_s", "limit": 0.05, "value": 0.05 * tpot, "met": tpot <= 1.0, "ratio": tpot}]
    return lambda ptp, dtp, router: ProbeCache(lambda p, d: (p, d), evaluate, lambda p, d: f"{p}:{d}", lambda msg: None)


def test_the_binding_role_is_reported():
    (res,) = search_pd(_role_probe(5, 2), [1], [4], [{"type": "round_robin"}], max_prefill=8, max_decode=4)
    assert res.counts == (5, 2) and res.gpus == 5 + 2 * 4
    binds = res.binds()
    assert "at 5P:2D: ttft_p99_s 2 s of 2 s (met)" in binds
    assert "prefill binds at 4P:2D: ttft_p99_s 2.5 s of 2 s (missed)" in binds
    assert "decode binds at 5P:1D: tpot_p99_s 100 ms of 50 ms (missed)" in binds
    (one,) = search_pd(_role_probe(1, 1), [1], [1], [{"type": "llm_d"}], max_prefill=2, max_decode=2)
    assert one.counts == (1, 1) and "prefill: at its minimum (1)" in one.binds()
    (never,) = search_pd(_role_probe(9, 1), [1], [1], [{"type": "llm_d"}], max_prefill=4, max_decode=2)
    assert never.counts is None and never.gpus is None and never.instances_text == "> 4P:2D"


RAW_AGG = {"instances": [{"name": "r", "count": 4, "data_parallel_size": 2}], "router": {"type": "round_robin"}}


def _by_construction(values):
    """Aggregated: 6 replicas at TP1 or 2 at TP2 meet the SLO; P/D: 2 prefill (TP1) + 1 decode (TP2)."""
    insts = {i.get("role", "both"): (i["count"], i["engine"]["tensor_parallel_size"]) for i in values["cluster.instances"]}
    if "both" in insts:
        n, tp = insts["both"]
        ratio = (6 if tp == 1 else 2) / n
    else:
        (p, ptp), (d, dtp) = insts["prefill"], insts["decode"]
        ratio = max(2 / p, (1 if dtp == 2 else 3) / d) if ptp == 1 else 9.0
    return [{"name": "ttft_p99_s", "limit": 2.0, "value": 2 * ratio, "met": ratio <= 1.0, "ratio": ratio}]


def test_pd_and_aggregated_deployments_ranked_together():
    space = DeploymentSpace([1, 2], [1, 2], [1, 2], [{"type": "round_robin"}], 8, 4, 4)
    res = search_space(lambda values: values, RAW_AGG, space, lambda msg: None, evaluate=_by_construction)
    got = [(r.kind, r.tp_text, r.instances_text, r.gpus) for r in res]
    # aggregated GPUs count the instance's DP (2 ranks per replica)
    assert got[:3] == [("P/D", "P1:D2", "2P:1D", 4), ("P/D", "P1:D1", "2P:3D", 5), ("aggregated", "2", "2", 8)]
    assert ("aggregated", "1", "6", 12) in got
    assert got[-2:] == [("P/D", "P2:D1", "> 4P:4D", None), ("P/D", "P2:D2", "> 4P:4D", None)]


def test_templates_of_each_kind_of_config():
    t = pd_templates(RAW_AGG)
    assert t["prefill"] == {"name": "prefill", "count": 4, "role": "prefill"}  # no DP in a P/D instance
    assert t["decode"]["role"] == "decode"
    pd = {"instances": [{"name": "p", "count": 8, "role": "prefill"},
                        {"name": "d", "count": 2, "role": "decode",
                         "engine": {"tensor_parallel_size": 4,
                                    "kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}}}]}
    assert pd_templates(pd)["decode"]["name"] == "d"
    agg = aggregated_template(pd)  # the decode instance serving alone
    assert agg == {"name": "r", "count": 2, "role": "both", "engine": {"tensor_parallel_size": 4}}
