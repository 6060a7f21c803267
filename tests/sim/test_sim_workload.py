"""Workloads: determinism, shared prefixes, caps, traces, validation errors."""
import json

import numpy as np
import pytest

from servetwin.core.config_error import ConfigError
from servetwin.sim.arrivals import ClosedLoop, Poisson
from servetwin.sim.workload import WorkloadSpec, build_workload, generate_requests

BASE = {"seed": 3, "requests": 50, "prompt_tokens": {"type": "uniform", "low": 5, "high": 60},
        "output_tokens": {"type": "lognormal", "mean": 30, "cv": 0.8},
        "arrival": {"type": "poisson", "rate": 10}}


def test_same_seed_same_requests_different_seed_different():
    _, a = build_workload(BASE, vocab_size=1000)
    _, b = build_workload(BASE, vocab_size=1000)
    _, c = build_workload({**BASE, "seed": 4}, vocab_size=1000)
    assert a == b
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]
    assert [r.request_id for r in a] == [f"req-{i}" for i in range(50)]
    assert all(0 <= t < 1000 for r in a for t in r.prompt_token_ids)
    assert all(5 <= len(r.prompt_token_ids) <= 60 for r in a)


def test_changing_the_arrival_process_keeps_the_prompts():
    _, a = build_workload(BASE, vocab_size=1000)
    _, b = build_workload({**BASE, "arrival": {"type": "gamma", "rate": 3, "cv": 2}}, vocab_size=1000)
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    assert [r.max_tokens for r in a] == [r.max_tokens for r in b]
    assert [r.arrival_s for r in a] != [r.arrival_s for r in b]
    times = [r.arrival_s for r in a]
    assert times == sorted(times) and times[0] > 0


def test_shared_prefix_groups_hash_equal_and_differ_from_the_first_token():
    cfg = {"seed": 0, "shared_prefix": {"groups": 20, "per_group": 4, "prefix_tokens": 64,
                                 "suffix_tokens": {"type": "uniform", "low": 0, "high": 30}},
           "output_tokens": 8}
    spec, reqs = build_workload(cfg, vocab_size=50)
    assert spec.requests == 80 and len(reqs) == 80
    by_group = {}
    for r in reqs:
        by_group.setdefault(r.group, []).append(r.prompt_token_ids)
    assert sorted(by_group) == list(range(20))
    firsts = set()
    for prompts in by_group.values():
        assert len(prompts) == 4
        assert all(p[:64] == prompts[0][:64] for p in prompts)
        firsts.add(prompts[0][0])
    assert len(firsts) == 20  # every group starts with its own token
    # grouped order: the members of a group are consecutive
    assert [r.group for r in reqs[:8]] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_prefix_orders():
    cfg = {"shared_prefix": {"groups": 3, "per_group": 2, "prefix_tokens": 16, "order": "interleaved"},
           "output_tokens": 4}
    _, reqs = build_workload(cfg, vocab_size=100)
    assert [r.group for r in reqs] == [0, 1, 2, 0, 1, 2]
    assert all(len(r.prompt_token_ids) == 16 for r in reqs)  # suffix_tokens defaults to 0
    cfg["shared_prefix"]["order"] = "shuffled"
    _, shuffled = build_workload(cfg, vocab_size=100)
    assert sorted(r.group for r in shuffled) == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("order", ["grouped", "interleaved", "shuffled"])
def test_a_repeated_prefix_pattern_keeps_its_groups_density_with_new_groups_each_time(order):
    cfg = {"seed": 3, "shared_prefix": {"groups": 4, "per_group": 3, "prefix_tokens": 16, "order": order,
                                        "suffix_tokens": {"type": "uniform", "low": 0, "high": 9}},
           "output_tokens": 4, "arrival": {"type": "poisson", "rate": 10}}
    _, once = build_workload(cfg, vocab_size=200)
    _, same = build_workload({**cfg, "shared_prefix": {**cfg["shared_prefix"], "repeat": 1}}, vocab_size=200)
    assert [(r.prompt_token_ids, r.max_tokens, r.arrival_s) for r in once] == \
        [(r.prompt_token_ids, r.max_tokens, r.arrival_s) for r in same]  # (repeat 1: the plain workload)
    spec, reqs = build_workload({**cfg, "shared_prefix": {**cfg["shared_prefix"], "repeat": 3}}, vocab_size=200)
    assert spec.requests == len(reqs) == 36
    for k in range(3):  # each time the pattern: its own 4 groups, each member once, in the order's shape
        block = reqs[12 * k:12 * (k + 1)]
        assert sorted(r.group for r in block) == [g for g in range(4 * k, 4 * k + 4) for _ in range(3)]
        if order != "shuffled":
            assert [r.group - 4 * k for r in block] == [r.group for r in once]
    firsts = {r.group: r.prompt_token_ids[0] for r in reqs}
    assert len(set(firsts.values())) == 12  # every group its own first token: no prefix shared across times
    for bad, path in [({"repeat": 0}, "workload.shared_prefix.repeat"),
                      ({"repeat": 2, "order": "inference_perf"}, "workload.shared_prefix.repeat"),
                      ({"repeat": 60}, "workload.shared_prefix.groups")]:  # 240 groups > a vocabulary of 200
        with pytest.raises(ConfigError) as err:
            build_workload({**cfg, "shared_prefix": {**cfg["shared_prefix"], **bad}}, vocab_size=200)
        assert err.value.path == path
    with pytest.raises(ConfigError, match=r"shared_prefix.per_group \* shared_prefix.repeat = 36"):
        build_workload({**cfg, "requests": 12, "shared_prefix": {**cfg["shared_prefix"], "repeat": 3}}, vocab_size=200)


def test_caps_n_priority_and_eos_finish():
    cfg = {"requests": 200, "prompt_tokens": {"type": "normal", "mean": 100, "std": 200},
           "output_tokens": {"type": "lognormal", "mean": 100, "sigma": 1.5},
           "max_prompt_tokens": 150, "max_output_tokens": 120, "n": 3, "priority": [0, 5]}
    _, reqs = build_workload(cfg, vocab_size=500)
    lens = [len(r.prompt_token_ids) for r in reqs]
    assert min(lens) >= 1 and max(lens) == 150
    assert max(r.max_tokens for r in reqs) == 120 and min(r.max_tokens for r in reqs) >= 1
    assert {r.n for r in reqs} == {3} and {r.priority for r in reqs} == {0, 5}
    assert all(r.eos_at is None for r in reqs)
    _, eos = build_workload({**cfg, "finish": "eos"}, vocab_size=500)
    assert {r.max_tokens for r in eos} == {120}
    assert [r.eos_at for r in eos] == [r.max_tokens for r in reqs]


def test_closed_loop_requests_have_no_times_yet():
    spec, reqs = build_workload({"requests": 5, "arrival": {"type": "closed_loop", "clients": 2}},
                                vocab_size=100)
    assert isinstance(spec.arrival, ClosedLoop) and all(r.arrival_s == 0.0 for r in reqs)


def test_workload_spec_defaults_and_direct_use():
    spec = WorkloadSpec(requests=3, arrival=Poisson(2.0), vocab_size=64)
    reqs = generate_requests(spec, id_prefix="x")
    assert [r.request_id for r in reqs] == ["x0", "x1", "x2"]
    assert all(len(r.prompt_token_ids) == 128 and r.max_tokens == 128 for r in reqs)


def test_trace_csv_and_jsonl(tmp_path):
    csv_path = tmp_path / "t.csv"
    csv_path.write_text("arrival_s,prompt_tokens,output_tokens,prefix_group,prefix_tokens\n"
                        "0.5,40,7,job1,32\n0.1,20,3,,\n0.5,50,9,job1,16\n2.0,33,1,job2,32\n")
    spec, reqs = build_workload({"arrival": {"type": "trace", "path": str(csv_path)}},
                                vocab_size=300)
    assert [r.arrival_s for r in reqs] == [0.1, 0.5, 0.5, 2.0]  # sorted, ties in file order
    assert [len(r.prompt_token_ids) for r in reqs] == [20, 40, 50, 33]
    assert [r.max_tokens for r in reqs] == [3, 7, 9, 1]
    a, b, c = reqs[1].prompt_token_ids, reqs[2].prompt_token_ids, reqs[3].prompt_token_ids
    assert a[:16] == b[:16] and a[:32] != b[:32]  # b shares only its 16 prefix tokens
    assert a[0] != c[0]  # different groups differ from the first token
    assert reqs[0].group is None and reqs[1].group == reqs[2].group != reqs[3].group
    jl = tmp_path / "t.jsonl"
    jl.write_text("\n".join(json.dumps(d) for d in [
        {"arrival_time": 1.0, "prompt_tokens": 5, "output_tokens": 2},
        {"timestamp": 0.0, "input_length": 6, "output_length": 4}]) + "\n")
    _, reqs = build_workload({"arrival": {"type": "trace", "path": str(jl)}, "requests": 1},
                             vocab_size=300)
    assert len(reqs) == 1 and len(reqs[0].prompt_token_ids) == 6 and reqs[0].arrival_s == 0.0


@pytest.mark.parametrize("cfg, message", [
    ({"requests": 5, "arrival": {"type": "poisson", "rate": -1}},
     "workload.arrival.rate: must be > 0, got -1"),
    ({"requests": 5, "arrival": {"type": "gamma", "rate": 1}},
     "workload.arrival.cv: required field is missing"),
    ({"requests": 5, "arrival": {"type": "bursty"}}, "workload.arrival.type: must be one of"),
    ({"requests": 5, "arrival": {"type": "closed_loop", "clients": 0}},
     "workload.arrival.clients: must be >= 1"),
    ({"requests": 5, "arrival": {"type": "trace", "path": "/no/such.csv"}},
     "workload.arrival.path: trace file not found"),
    ({"requests": 0}, "workload.requests: must be >= 1"),
    ({}, "workload.requests: required field is missing"),
    ({"requests": 5, "prompt_tokens": {"type": "zipf"}}, "workload.prompt_tokens.type"),
    ({"requests": 5, "prompt_tokens": {"type": "uniform", "low": 9, "high": 3}},
     "workload.prompt_tokens.high: must be >= 9"),
    ({"requests": 5, "output_tokens": {"type": "lognormal", "mean": 5}},
     "workload.output_tokens: give exactly one of 'sigma' or 'cv'"),
    ({"requests": 5, "prompt_lens": 5}, "workload.prompt_lens: unknown field"),
    ({"shared_prefix": {"groups": 2, "per_group": 2}}, "workload.shared_prefix.prefix_tokens: required"),
    ({"shared_prefix": {"groups": 300, "per_group": 1, "prefix_tokens": 4}}, "workload.shared_prefix.groups"),
    ({"requests": 3, "shared_prefix": {"groups": 2, "per_group": 2, "prefix_tokens": 4}},
     "workload.requests: 3 disagrees"),
    ({"prompt_tokens": 4, "shared_prefix": {"groups": 2, "per_group": 2, "prefix_tokens": 4}},
     "workload.prompt_tokens: not allowed with workload.shared_prefix"),
    ({"max_prompt_tokens": 4, "shared_prefix": {"groups": 2, "per_group": 2, "prefix_tokens": 4}},
     "workload.shared_prefix.prefix_tokens: 4 leaves no room"),
    ({"requests": 5, "finish": "eos"}, "workload.max_output_tokens: required"),
    ({"requests": 5, "n": 0}, "workload.n: must be >= 1"),
])
def test_validation_errors_name_the_field(cfg, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        build_workload(cfg, vocab_size=256)


def test_trace_errors_name_file_line_and_field(tmp_path):
    p = tmp_path / "bad.csv"
    p.write_text("arrival_s,prompt_tokens,output_tokens\n0,10,5\n1,x,5\n")
    with pytest.raises(ValueError, match=r"bad\.csv:3\.prompt_tokens: must be an integer"):
        build_workload({"arrival": {"type": "trace", "path": str(p)}})
    p.write_text("arrival_s,prompt_tokens\n0,10\n")
    # a column missing from the whole file: the error lists the columns found and the ones accepted
    with pytest.raises(ValueError, match=r"bad\.csv has columns arrival_s, prompt_tokens; accepted: azure: "):
        build_workload({"arrival": {"type": "trace", "path": str(p)}})
    p.write_text("arrival_s,prompt_tokens,output_tokens\n0,10,\n")
    with pytest.raises(ValueError, match=r"bad\.csv:2\.output_tokens: required field is missing"):
        build_workload({"arrival": {"type": "trace", "path": str(p)}})
    p.write_text("arrival_s,prompt_tokens,output_tokens\n0,10,5\n")
    with pytest.raises(ValueError, match="workload.prompt_tokens: not allowed with a trace"):
        build_workload({"arrival": {"type": "trace", "path": str(p)}, "prompt_tokens": 3})


def test_draw_tokens_is_the_same_draw_with_shared_int_objects():
    from servetwin.sim.workload import draw_tokens
    a = draw_tokens(np.random.default_rng(3), 50_000, 300)
    b = np.random.default_rng(3).integers(0, 50_000, size=300).tolist()
    assert a == b and all(type(t) is int for t in a)
    c = draw_tokens(np.random.default_rng(4), 50_000, 300)
    first = {t: t for t in a}
    shared = [t for t in c if t in first]
    assert shared and all(first[t] is t for t in shared)  # one object per token id (8 bytes a token, not 36)


@pytest.mark.parametrize("vocab", [50, 32_000, 128_256, 262_144])
def test_draw_token_lists_equals_one_draw_per_prompt(vocab):
    from servetwin.sim.workload import draw_token_lists, draw_tokens
    sizes = np.random.default_rng(vocab % 97).integers(0, 300, size=120).tolist() + [0, 1]
    g1, g2 = np.random.default_rng(11), np.random.default_rng(11)
    one_by_one = [draw_tokens(g1, vocab, k) for k in sizes]
    assert draw_token_lists(g2, vocab, sizes, chunk_tokens=1000) == one_by_one  # several chunks
    assert g1.integers(0, 10**9, size=5).tolist() == g2.integers(0, 10**9, size=5).tolist()  # same state after


def test_draw_token_lists_in_one_chunk_or_many_is_the_same_draw():
    from servetwin.sim.workload import draw_token_lists
    sizes = [5, 0, 3000, 7, 1, 250]
    one = draw_token_lists(np.random.default_rng(2), 32_000, sizes)
    for chunk in (1, 6, 3000, 10**9):
        assert draw_token_lists(np.random.default_rng(2), 32_000, sizes, chunk_tokens=chunk) == one


# -- issue 38 item 8: a run that would not fit the memory budget is refused before it is built -----------
def test_a_run_past_the_memory_budget_is_refused_naming_the_override(monkeypatch):
    from servetwin.core.config_error import ConfigError
    from servetwin.sim.workload import WorkloadSpec, generate_requests

    spec = WorkloadSpec.from_dict({"requests": 1000, "prompt_tokens": 100_000, "output_tokens": 10})
    with pytest.raises(ConfigError, match=r"workload.requests: 1,000 requests of 100,000,000 prompt and 10,000 "
                                          r"output tokens would need about 2,491 MB, more than the run memory limit "
                                          r"of 2,048 MB .*SERVETWIN_MAX_RUN_MEMORY_MB"):
        generate_requests(spec)
    monkeypatch.setenv("SERVETWIN_MAX_RUN_MEMORY_MB", "1")
    with pytest.raises(ConfigError, match="more than the run memory limit of 1 MB"):
        generate_requests(WorkloadSpec.from_dict({"requests": 100_000, "prompt_tokens": 1, "output_tokens": 1}))
    monkeypatch.setenv("SERVETWIN_MAX_RUN_MEMORY_MB", "300")
    assert len(generate_requests(WorkloadSpec.from_dict({"requests": 10, "prompt_tokens": 5, "output_tokens": 1}))) == 10


def test_inference_perf_order_resends_the_shuffled_prompts_from_the_start_each_stage():
    """inference-perf: prompts made group by group, shuffled once; each stage sends them from index 0 again,
    wrapping around; a resent prompt is the same text."""
    cfg = {"seed": 3, "vocab_size": 1000, "output_tokens": 4,
           "shared_prefix": {"groups": 3, "per_group": 2, "prefix_tokens": 8, "suffix_tokens": 4,
                             "order": "inference_perf"},
           "arrival": {"type": "stages", "stages": [{"rate": 4, "duration_s": 1}, {"rate": 8, "duration_s": 1}]}}
    reqs = generate_requests(WorkloadSpec.from_dict(cfg))
    assert len(reqs) == 4 + 8
    base = [tuple(r.prompt_token_ids) for r in reqs[4:10]]
    assert len(set(base)) == 6  # stage 2 wraps: all six prompts once, then the first two again
    assert [tuple(r.prompt_token_ids) for r in reqs[:4]] == base[:4] == [tuple(r.prompt_token_ids) for r in reqs[4:8]]
    assert [tuple(r.prompt_token_ids) for r in reqs[10:]] == base[:2]
    groups = {}
    for r, p in zip(reqs[4:10], base):
        groups.setdefault(r.group, set()).add(p[:8])
    assert sorted(len(g) for g in groups.values()) == [1, 1, 1] and len(groups) == 3  # one prefix per group
    with pytest.raises(ConfigError) as e:
        WorkloadSpec.from_dict({**cfg, "requests": 6})
    assert "workload.requests" in str(e.value) and "12" in str(e.value)
