"""A cluster run's output phase (experiments/run/cluster_run.py): sim/trace.json written by a forked child
while the tables and summaries are built gives the files the one-process writing gives, each listed once
in the folder's marker; a child that fails is redone in the parent."""
from __future__ import annotations

import json
import os

import pytest
import yaml

from servetwin.experiments.cli import main
from servetwin.experiments.run import cluster_run
from servetwin.experiments.run.background import parallel_ok
from servetwin.experiments.run.run_folder import MARKER

CONFIG = {"name": "c", "model": "tiny-llama", "hardware": "h100-sxm",
          "engine": {"max_num_seqs": 4, "max_model_len": 256, "num_gpu_blocks": 24},  # preemptions
          "workload": {"requests": 24, "prompt_tokens": 96, "output_tokens": 40,
                       "arrival": {"type": "poisson", "rate": 80}},
          "output": {"step_requests": True, "plots": False},
          "cluster": {"instances": [{"name": "a", "count": 2}, {"name": "b", "data_parallel_size": 2}],
                      "router": {"type": "round_robin"}}}
HOST_TIMES = ("wall_s", "sim_speedup_x")


def _run(tmp_path, name: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
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


def test_a_trace_child_that_fails_is_redone_in_the_parent(tmp_path, monkeypatch):
    parent = os.getpid()
    write = cluster_run.write_cluster_trace_file

    def fails_in_a_child(*args):
        if os.getpid() != parent:
            raise RuntimeError("the child's write fails")
        return write(*args)

    monkeypatch.setattr(cluster_run, "write_cluster_trace_file", fails_in_a_child)
    out = _run(tmp_path, "out")
    trace = json.loads(open(os.path.join(out, "sim", "trace.json")).read())  # complete: it parses
    assert any(e["ph"] == "i" and e["name"].startswith("preempted") for e in trace["traceEvents"])
    assert _marker_lines(out).count(os.path.join("sim", "trace.json")) == 1
