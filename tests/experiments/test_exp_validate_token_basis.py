"""Published inference-perf figures on the engine-token basis (experiments/validate/token_basis.py)."""
import json
import pathlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from exptest_helpers import STAGED_CLUSTER
from servetwin.experiments.cli import main
from servetwin.experiments.validate.published import CaseResult, load_published
from servetwin.experiments.validate.token_basis import basis_case, convert_figures, engine_tokens

ROOT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "published_cluster"
PD = "pd_gptoss120b_h200_8p_tp1_2d_tp4"


def _report(ttft, span, client_counts, total_time):
    """A run's figures as inference-perf's reportgen/base.py computes them from its successful requests: TTFT,
    last-token - first-token span (the response ending with its last token) and client-side count per request."""
    ttft, span, n = (np.asarray(x, dtype=float) for x in (ttft, span, client_counts))
    return {"out_tok_s": n.sum() / total_time, "req_s": len(n) / total_time,
            "ttft_mean": ttft.mean(), "e2e_mean": (ttft + span).mean(), "tpot_mean": (span / (n - 1)).mean()}


def test_the_pd_reports_figures_on_the_engine_basis():
    _, published = load_published(ROOT)
    entry = published[PD]
    figures = entry["published"]
    conv = convert_figures(figures, 250, entry["token_basis"]["client_tokens_per_request"])
    assert conv["out_tok_s"].value == pytest.approx(12035.8525 * 250 / 282.66)  # 10,645 decoded tok/s
    assert conv["tpot_mean"].value == pytest.approx((2775.4784 - 1156.8768) / 249)  # 6.50 ms per decoded token
    for metric in ("tpot_p50", "tpot_p99", "itl_mean", "itl_p99"):  # not convertible: they stand as published
        assert conv[metric].value is None and conv[metric].how
    # TTFT, E2E and req/s count no tokens: not in the answer
    assert set(conv) == {"out_tok_s", "tpot_mean", "tpot_p50", "tpot_p99", "itl_mean", "itl_p99"}


def test_basis_rows_keep_basis_free_figures_and_name_the_conversion():
    _, published = load_published(ROOT)
    rows = [("out_tok_s", 12035.8525, 11000.0), ("req_s", 42.581, 44.0), ("itl_mean", 4.8874, 7.7)]
    case = basis_case(CaseResult(PD, "s", rows), published[PD], 250)
    by = {m: (pub, basis, how) for m, pub, basis, _, how in case.rows}
    assert by["req_s"][:2] == (42.581, 42.581) and by["req_s"][2] == "same on both bases"
    assert by["out_tok_s"][1] == pytest.approx(10645.1, abs=0.1) and "282.66" in by["out_tok_s"][2]
    assert by["itl_mean"][1] == 4.8874 and by["itl_mean"][2].startswith("as published")
    assert "282.66" in case.counts and "source:" in case.counts
    unfixed = basis_case(CaseResult(PD, "s", rows), published[PD], None)  # the workload does not fix the count
    assert all(basis == pub for _, pub, basis, _, _ in unfixed.rows) and unfixed.counts.startswith("not converted")


requests = st.lists(st.tuples(st.floats(0.01, 5.0), st.floats(0.1, 30.0), st.integers(2, 900)), min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(requests, st.integers(2, 600), st.floats(1.0, 500.0))
def test_conversion_is_exact_where_inference_perf_defines_the_figure(reqs, engine, total_time):
    """Output tok/s and the TPOT mean converted with the report's own count equal the figures the same requests
    give when each counts the engine's tokens (whatever the per-request client counts)."""
    ttft, span, counts = zip(*reqs)
    client_report = _report(ttft, span, counts, total_time)
    engine_report = _report(ttft, span, [engine] * len(reqs), total_time)
    client = client_report["out_tok_s"] / client_report["req_s"]
    conv = convert_figures(client_report, engine, client)
    assert conv["out_tok_s"].value == pytest.approx(engine_report["out_tok_s"], rel=1e-9)
    assert conv["tpot_mean"].value == pytest.approx(engine_report["tpot_mean"], rel=1e-9)


@settings(max_examples=200, deadline=None)
@given(requests, st.floats(1.0, 500.0), st.floats(1.0, 1e6))
def test_converting_with_factor_one_changes_nothing(reqs, total_time, tot_extra):
    ttft, span, _ = zip(*reqs)
    engine = reqs[0][2]
    report = _report(ttft, span, [engine] * len(reqs), total_time)  # the client counted what the engine decoded
    report["tot_tok_s"] = report["out_tok_s"] + tot_extra
    conv = convert_figures(report, engine, float(engine))
    for metric in ("out_tok_s", "tot_tok_s", "tpot_mean"):
        assert conv[metric].value == pytest.approx(report[metric], rel=1e-9)


@settings(max_examples=200, deadline=None)
@given(st.floats(1.0, 1e5), st.floats(1.0, 1e5), st.floats(2.0, 1000.0), st.floats(2.0, 1000.0),
       st.floats(0.0, 1e4), st.floats(0.0, 1e4), st.integers(2, 1000))
def test_conversion_is_monotone(v1, v2, c1, c2, a, b, engine):
    """A larger published figure stays larger on the engine basis; a larger client count gives a smaller
    engine-basis throughput; the TPOT mean grows with the E2E mean and falls with the TTFT mean."""
    lo, hi = sorted((v1, v2))
    clo, chi = sorted((c1, c2))
    out = lambda v, c: convert_figures({"out_tok_s": v}, engine, c)["out_tok_s"].value  # noqa: E731
    assert out(lo, clo) <= out(hi, clo) and out(lo, chi) <= out(lo, clo)
    tpot = lambda e2e, ttft: convert_figures({"tpot_mean": 1.0, "e2e_mean": e2e, "ttft_mean": ttft},  # noqa: E731
                                             engine, None)["tpot_mean"].value
    t_lo, t_hi = sorted((a, b))
    assert tpot(1e4 + t_lo, 5.0) <= tpot(1e4 + t_hi, 5.0) and tpot(2e4, t_hi) <= tpot(2e4, t_lo)


def test_engine_count_needs_a_fixed_length_and_max_tokens():
    from servetwin.experiments.config.schema import load_config
    spec = load_config(ROOT / "cases" / f"{PD}.yaml").workload.spec
    assert engine_tokens(spec) == 250
    spec.max_output_tokens = 200  # the workload caps the sampled length
    assert engine_tokens(spec) == 200
    spec.finish = "eos"  # a request may stop early: the engine's count is not fixed
    assert engine_tokens(spec) is None




def _basis_dir(tmp_path, stage_count=7.5):
    (tmp_path / "cases").mkdir(parents=True)
    (tmp_path / "cases" / "a.yaml").write_text(STAGED_CLUSTER.format(name="a", router="{type: round_robin}"))
    per_stage = [{"rate": 3, "out_tok_s": 20.0, "ttft_mean": 30.0, "e2e_mean": 80.0},
                 {"rate": 4, "out_tok_s": 25.0, "ttft_mean": 30.0}]
    pub = {"a": {"source": "made up", "published": {}, "stages": {"first": 1, "per_stage": per_stage},
                 "token_basis": {"per_stage": [{"rate": 3, "client_tokens_per_request": stage_count,
                                                "source": "made up: the stage's out tok/s / req/s"}],
                                 "not_converted": "stage 4 gives no count"}}}
    (tmp_path / "published.json").write_text(json.dumps(pub))
    return tmp_path


def test_validate_prints_both_bases(tmp_path, capsys):
    d = _basis_dir(tmp_path)
    out_md = tmp_path / "out.md"
    assert main(["validate", str(d), "-q", "-o", str(out_md)]) == 0
    text = capsys.readouterr().out
    assert "| case | metric | published | predicted | error |" in text  # the as-published table, unchanged
    assert "| a | out_tok_s@3 | 20 |" in text
    assert "## Engine-token basis" in text and "6 tokens decoded per request" in text
    assert "@3: 6 / 7.5 (source: made up" in text and "stage 4 gives no count" in text
    assert "| a | out_tok_s@3 | 20 | 16 |" in text  # 20 x 6 / 7.5
    assert "| a | out_tok_s@4 | 25 | 25 |" in text and "as published: the report gives no client-side" in text
    assert "| whole folder | throughput/duration |" in text and "| 2 (1) |" in text
    assert "## Engine-token basis" in out_md.read_text()


def test_a_count_that_contradicts_the_figures_is_refused(tmp_path, capsys):
    _, published = load_published(ROOT)
    entry = published[PD]
    d = tmp_path
    (d / "cases").mkdir()
    (d / "cases" / "a.yaml").write_text(STAGED_CLUSTER.format(name="a", router="{type: round_robin}"))
    bad = {**entry["token_basis"], "client_tokens_per_request": 250}  # not the report's 12,035.85 / 42.581
    (d / "published.json").write_text(json.dumps({"a": {**entry, "token_basis": bad}}))
    assert main(["validate", str(d), "-q"]) == 2
    assert "published.json.a.token_basis.client_tokens_per_request: 250 but the same figures' out_tok_s / req_s " \
           "is 282.658" in capsys.readouterr().err
    (d / "published.json").write_text(json.dumps({"a": {**entry, "token_basis": {"per_stage": [{"rate": 9}]}}}))
    assert main(["validate", str(d), "-q"]) == 2
    assert "token_basis.per_stage[0]: must name the `rate` of a published stage" in capsys.readouterr().err
    (d / "published.json").write_text(json.dumps({"a": {**entry, "token_basis": {"per_stage": "all"}}}))
    assert main(["validate", str(d), "-q"]) == 2
    assert "token_basis.per_stage: must be a list" in capsys.readouterr().err
