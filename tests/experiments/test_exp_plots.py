"""Figures of a run and of a sweep: files, units, axis kinds, spread columns, SLO parsing."""
import json

import matplotlib
import pandas as pd
import pytest
from exptest_helpers import tiny, write_yaml

from servetwin.experiments.run import plots
from servetwin.experiments.cli import main
from servetwin.experiments.common.units import axis_unit, format_seconds

matplotlib.use("Agg")


@pytest.mark.parametrize("v, text", [(37.2961, "37.3 s"), (0.0371, "37.1 ms"), (0.00042, "420 us"),
                                     (372.96, "6.22 min"), (None, "-"), (0, "0 s")])
def test_format_seconds_picks_the_unit(v, text):
    assert format_seconds(v) == text


def test_axis_unit_keeps_seconds_up_to_ten_minutes():
    assert axis_unit(164.0) == (1.0, "s") and axis_unit(0.2) == (1e-3, "ms") and axis_unit(3600)[1] == "min"


def test_slo_targets_and_title():
    ctx = plots.PlotContext(slo={"ttft_p99_s": 0.5, "tpot_p50_s": 0.05, "e2e_p90_s": 3, "deadline": 1})
    assert ctx.slo_targets("ttft") == [("p99", 0.5)] and ctx.slo_targets("itl") == []
    text = plots.engine_settings({"max_num_seqs": 8, "enable_prefix_caching": False, "async_scheduling": True}, 64)
    assert text == "max_num_seqs 8, no prefix caching, async scheduling, 64 KV blocks"


def test_run_with_preemptions_draws_every_figure(tmp_path):
    cfg = tiny(engine__num_gpu_blocks=12, engine__max_num_seqs=8, engine__max_model_len=128, workload__requests=12,
               workload__output_tokens=40)
    out = tmp_path / "out"
    assert main(["run", str(write_yaml(tmp_path / "t.yaml", cfg)), "-o", str(out), "--no-progress"]) == 0
    s = json.loads((out / "summary.json").read_text())["backends"]["sim"]
    assert s["preemptions"] > 0  # the timeline and the Gantt have something to mark
    for name in plots.RUN_FIGURES:
        assert (out / f"{name}.png").stat().st_size > 10_000, name
    report = (out / "report.md").read_text()
    assert "request_gantt.png" in report
    trace = json.loads((out / "sim/trace.json").read_text())
    assert any(e["ph"] == "i" for e in trace["traceEvents"])  # preemption instants


def test_serial_drawing_gives_the_same_files(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVETWIN_SERIAL_OUTPUT", "1")
    out = tmp_path / "out"
    assert main(["run", str(write_yaml(tmp_path / "t.yaml", tiny())), "-o", str(out), "--no-progress"]) == 0
    assert all((out / f"{n}.png").is_file() for n in plots.RUN_FIGURES) and (out / "sim/trace.json").is_file()


def _sweep_df(xs, backend="sim", spread=False):
    rows = []
    for i, x in enumerate(xs):
        row = {"point": f"p{i}", "engine.max_num_seqs": x, "backend": backend, "status": "ok",
               "throughput_tok_s": 100.0 * (i + 1), "request_throughput_s": 1.0 + i, "ttft_p50_s": 0.01 * (i + 1),
               "ttft_p99_s": 0.05 * (i + 1), "tpot_p50_s": 0.01, "tpot_p99_s": 0.02, "e2e_p50_s": 1.0,
               "e2e_p99_s": 2.0, "duration_s": 10.0 - i}
        if spread:
            row["ttft_p99_s_ci_low"], row["ttft_p99_s_ci_high"] = row["ttft_p99_s"] * 0.8, row["ttft_p99_s"] * 1.3
        rows.append(row)
    return pd.DataFrame(rows)


def test_numeric_sweep_is_drawn_as_lines_with_error_bars(tmp_path):
    df = _sweep_df([8, 16, 32], spread=True)
    below, above = plots.spread(df, "ttft_p99_s")
    assert below == pytest.approx([0.01, 0.02, 0.03]) and above == pytest.approx([0.015, 0.03, 0.045])
    assert plots.spread(df, "ttft_p50_s") is None
    assert plots.is_numeric_axis(df["engine.max_num_seqs"].tolist())
    ctx = plots.PlotContext(title="t", slo={"ttft_p99_s": 0.1})
    path = plots.sweep_comparison(df, str(tmp_path / "s.png"), ctx, keys=["engine.max_num_seqs"])
    assert path and (tmp_path / "s.png").stat().st_size > 10_000


def test_categorical_sweep_is_drawn_as_bars(tmp_path):
    df = _sweep_df([True, False])
    assert not plots.is_numeric_axis(df["engine.max_num_seqs"].tolist())
    assert plots.sweep_comparison(df, str(tmp_path / "s.png"), None, keys=["engine.max_num_seqs"])


def _drawn_sweep(monkeypatch, df, tmp_path, ctx=None):
    """Draw the sweep figure and return its figure (kept open) instead of only the file."""
    kept = {}
    real = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: (kept.setdefault("fig", fig), path)[1])
    plots.sweep_comparison(df, str(tmp_path / "s.png"), ctx or plots.PlotContext(title="t"),
                           keys=["engine.max_num_seqs"])
    monkeypatch.setattr(plots, "_save", real)
    fig = kept["fig"]
    fig.canvas.draw()
    return fig, {ax.get_title().split(" (")[0]: ax for ax in fig.axes}


def test_numeric_sweep_axis_shows_a_tiny_difference_as_tiny(monkeypatch, tmp_path):
    # four points of a sweep the arrival rate binds: throughput differs by 0.004%, makespan ~7 min
    df = _sweep_df([64, 128, 256, 512])
    df["throughput_tok_s"] = [12190.0, 12190.5, 12190.2, 12189.9]
    df["duration_s"] = [415.0, 415.2, 415.1, 415.0]
    df.loc[2, "status"] = "interrupted"
    fig, ax = _drawn_sweep(monkeypatch, df, tmp_path)
    thr, span = ax["throughput"], ax["makespan"]
    # against the numeric swept values, on a numeric axis
    assert [t.get_text() for t in thr.get_xticklabels()] == ["64", "128", "256", "512"]
    assert thr.get_xaxis().get_scale() == "linear" and thr.get_xticks() == pytest.approx([64, 128, 256, 512])
    # from zero, without an offset or scientific notation: the lines are flat, as the numbers are
    assert thr.get_ylim()[0] == 0 and thr.yaxis.get_major_formatter().get_offset() == ""
    labels = [t.get_text() for t in thr.get_yticklabels()]
    assert all("e" not in lab and "+" not in lab for lab in labels)
    # the makespan's tick labels are all different (not eight times "7 min")
    spans = [t.get_text() for t in span.get_yticklabels()]
    assert len(spans) >= 3 and len(set(spans)) == len(spans) and span.get_ylim()[0] == 0
    # the interrupted point is marked and labelled
    assert any(t.get_text() == "partial" for t in thr.texts)
    assert "interrupted" in fig._suptitle.get_text()
    matplotlib.pyplot.close(fig)


def test_sweep_figure_subtitle_names_no_swept_value(tmp_path):
    cfg = tiny(sweep={"engine.max_num_seqs": [2, 4]}, workload__arrival={"type": "poisson", "rate": 3.0})
    from servetwin.experiments.config.schema import load_config

    exp = load_config(str(write_yaml(tmp_path / "c.yaml", cfg)), overrides=["workload.requests=9"])
    ctx = plots.context_for(exp)
    assert "max_num_seqs" not in ctx.settings and "max_num_batched_tokens 64" in ctx.settings
    assert ctx.title.endswith("9 requests at 3 req/s (poisson)")  # the --set shows in the title


def test_seeded_sweep_error_bars_are_the_clipped_interval_not_the_std():
    df = _sweep_df([8, 16])
    df["ttft_p99_s_ci_lo"], df["ttft_p99_s_ci_hi"] = [0.0, 0.08], [0.2, 0.12]
    df["ttft_p99_s_std"] = [1.0, 1.0]  # symmetric std bars would reach below zero
    below, above = plots.spread(df, "ttft_p99_s")
    assert below == pytest.approx([0.05, 0.02]) and above == pytest.approx([0.15, 0.02])


def test_a_sweep_over_hardware_draws_each_in_its_own_colour_and_marker(monkeypatch, tmp_path):
    # the figure: h200 and b200 on the simulator were one colour and one marker, titled "(sim on b200)"
    df = pd.concat([_sweep_df([8, 16, 32]).assign(hardware=hw, point=lambda d, hw=hw: d.point + hw)
                    for hw in ("h200", "b200")], ignore_index=True)
    kept = {}
    monkeypatch.setattr(plots, "_save", lambda fig, path: (kept.setdefault("fig", fig), path)[1])
    plots.sweep_comparison(df, str(tmp_path / "s.png"), plots.PlotContext(title="t"),
                           keys=["hardware", "engine.max_num_seqs"])
    ttft = next(ax for ax in kept["fig"].axes if ax.get_title().startswith("TTFT"))
    lines = {c.get_label(): c.lines[0] for c in ttft.containers if "hardware=" in str(c.get_label())}
    h200, b200 = lines["hardware=h200, sim p50"], lines["hardware=b200, sim p50"]
    assert h200.get_color() != b200.get_color() and h200.get_marker() != b200.get_marker()
    matplotlib.pyplot.close(kept["fig"])
    cfg = tiny(hardware="h100-sxm", sweep={"hardware": ["h200", "b200"]})
    from servetwin.experiments.config.schema import load_config

    title = plots.context_for(load_config(str(write_yaml(tmp_path / "c.yaml", cfg)))).title
    assert "(sim on h200, b200)" in title and "h100" not in title
