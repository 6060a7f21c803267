"""A cluster run's output phase (experiments/run/cluster_run.py): sim/trace.json and the steps tables written
by forked children while the other tables and summaries are built give the files the one-process writing
gives, each listed once in the folder's marker; a child that fails is redone in the parent."""
from __future__ import annotations

import json
import os

import pandas as pd
import pytest
import yaml

from servetwin.experiments.cli import main
from servetwin.experiments.run import cluster_run
from servetwin.experiments.run.background import parallel_ok
from servetwin.core.testbed.step_table import STEP_COLUMNS
from servetwin.experiments.config.schema import load_config
from servetwin.experiments.run.run_folder import MARKER
from servetwin.experiments.run.runner import summarize

CONFIG = {"name": "c", "model": "tiny-llama", "hardware": "h100-sxm",
          "engine": {"max_num_seqs": 4, "max_model_len": 256, "num_gpu_blocks": 24},  # preemptions
          "workload": {"requests": 24, "prompt_tokens": 96, "output_tokens": 40,
                       "arrival": {"type": "poisson", "rate": 80}},
          "output": {"step_requests": True, "plots": False},
          "cluster": {"instances": [{"name": "a", "count": 2}, {"name": "b", "data_parallel_size": 2}],
                      "router": {"type": "round_robin"}}}
HOST_TIMES = ("wall_s", "sim_speedup_x")


def _run(tmp_path, name: str, config: dict = CONFIG) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    out = str(tmp_path / name)
    assert main(["run", str(path), "-o", out, "--no-progress"]) == 0
    return out


def _files(root: str) -> dict[str, bytes]:
    out = {}
    for folder, _, names in os.walk(root):
        for n in names:
            path = os.path.join(folder, n)
            out[os.path.relpath(path, root)] = open(path, "rb").read()
    return out


def _without_host_times(data):
    if isinstance(data, dict):
        return {k: _without_host_times(v) for k, v in data.items() if k not in HOST_TIMES}
    return [_without_host_times(v) for v in data] if isinstance(data, list) else data


def _marker_lines(out: str) -> list[str]:
    return [line for line in open(os.path.join(out, MARKER)).read().splitlines() if not line.startswith("#")]


@pytest.mark.skipif(not parallel_ok(), reason="no fork or one CPU: the output phase runs in one process")
def test_the_forked_trace_gives_the_files_of_the_one_process_run(tmp_path, monkeypatch):
    forked = _run(tmp_path, "forked")
    monkeypatch.setenv("SERVETWIN_SERIAL_OUTPUT", "1")
    serial = _run(tmp_path, "serial")
    a, b = _files(forked), _files(serial)
    assert sorted(a) == sorted(b) and "sim/trace.json" in a
    summary = json.loads(a["summary.json"])
    assert summary["backends"]["sim"]["preemptions"] > 0  # (the config preempts: trace.json has its instants)
    for rel in a:
        if rel.endswith("summary.json"):
            assert _without_host_times(json.loads(a[rel])) == _without_host_times(json.loads(b[rel])), rel
        elif rel != MARKER:
            assert a[rel] == b[rel], rel
    lines = _marker_lines(forked)
    assert sorted(lines) == sorted(_marker_lines(serial)) and len(lines) == len(set(lines))  # each file once
    assert set(lines) == set(a) - {MARKER}


@pytest.mark.parametrize("job", ["write_cluster_trace_file", "write_steps_tables"])
def test_a_child_that_fails_is_redone_in_the_parent(tmp_path, monkeypatch, job):
    parent = os.getpid()
    write = getattr(cluster_run, job)

    def fails_in_a_child(*args):
        if os.getpid() != parent:
            raise RuntimeError("the child's write fails")
        return write(*args)

    monkeypatch.setattr(cluster_run, job, fails_in_a_child)
    out = _run(tmp_path, "out")
    trace = json.loads(open(os.path.join(out, "sim", "trace.json")).read())  # complete: it parses
    assert any(e["ph"] == "i" and e["name"].startswith("preempted") for e in trace["traceEvents"])
    lines = _marker_lines(out)
    assert lines.count(os.path.join("sim", "trace.json")) == 1
    steps = sorted(line for line in lines if line.endswith("steps.parquet"))
    assert steps == sorted(set(steps)) and len(steps) == 4  # one per engine, listed once
    assert all(pd.read_parquet(os.path.join(out, rel)).columns.tolist() == STEP_COLUMNS for rel in steps)


def test_summaries_from_the_parents_step_columns_equal_those_from_the_whole_tables(tmp_path):
    """The parent builds the steps tables with `PARENT_STEP_COLUMNS` alone (a child writes the whole ones):
    every engine's summary is the same, and those columns are the whole table's."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    exp = load_config(path)
    _, runs, _, _ = cluster_run.simulate_cluster(exp)
    for run in runs.values():
        itls, engine_itls = run.recorder.itl_arrays()
        whole, part = run.recorder.frames(), run.recorder.frames(cluster_run.PARENT_STEP_COLUMNS)
        assert len(whole["steps"]) > 0
        pd.testing.assert_frame_equal(part["steps"], whole["steps"][list(part["steps"].columns)])
        assert sorted(part["steps"].columns) == sorted(cluster_run.PARENT_STEP_COLUMNS)
        assert json.dumps(summarize(run, part, exp, itls, engine_itls)) == \
            json.dumps(summarize(run, whole, exp, itls, engine_itls))


@pytest.mark.parametrize("pd_roles", [False, True])
def test_a_probes_summary_is_the_written_runs(tmp_path, pd_roles):
    """`run_summary` (a capacity probe: nothing written) gives the summary.json of `servetwin run`, SLOs and the
    binding included, P/D's transfer summary too."""
    from servetwin.experiments.run.experiment import run_summary

    config = {**CONFIG, "slo": {"ttft_p99_s": 1.0, "engine_itl_p99_s": 0.5}}
    if pd_roles:
        config["cluster"] = {"instances": [{"name": "p", "role": "prefill", "count": 2}, {"name": "d", "role": "decode"}]}
    out = _run(tmp_path, "run", config)
    written = json.load(open(os.path.join(out, "summary.json")))
    exp = load_config(str(tmp_path / "c.yaml"))
    probe = json.loads(json.dumps(run_summary(exp), default=str))
    assert _without_host_times(probe) == _without_host_times(written)
    whole = written["backends"]["sim"]
    assert {c["name"] for c in whole["slo"]["checks"]} == {"ttft_p99_s", "engine_itl_p99_s"}
    assert whole["binding"]["resource"] and "steady_state" in whole and ("pd" in whole) == pd_roles
