"""A trace is streamed (issue 38 item 2): every line checked, only the `requests` earliest kept, a progress
line per PROGRESS_EVERY_LINES lines; the result equals sorting the whole file and cutting it."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servetwin.core.config_error import ConfigError
from servetwin.sim import trace_file
from servetwin.sim.trace_file import load_trace
from servetwin.sim.workload import WorkloadSpec


@settings(max_examples=40, deadline=None)
@given(arrivals=st.lists(st.integers(0, 5), min_size=1, max_size=40), limit=st.integers(1, 45),
       jsonl=st.booleans())
def test_the_earliest_n_are_the_sorted_files_first_n(tmp_path_factory, arrivals, limit, jsonl):
    d = tmp_path_factory.mktemp("t")
    if jsonl:
        f = d / "t.jsonl"
        f.write_text("".join(json.dumps({"arrival_s": a, "prompt_tokens": i + 1, "output_tokens": 1}) + "\n"
                             for i, a in enumerate(arrivals)))
    else:
        f = d / "t.csv"
        f.write_text("arrival_s,prompt_tokens,output_tokens\n" + "".join(f"{a},{i + 1},1\n"
                                                                          for i, a in enumerate(arrivals)))
    whole = load_trace(f, log=lambda m: None)
    assert [r.prompt_tokens for r in whole] == [i + 1 for i in sorted(range(len(arrivals)), key=lambda i: arrivals[i])]
    assert load_trace(f, limit=limit, log=lambda m: None) == whole[:limit]


def test_progress_lines_and_a_bad_line_past_the_kept_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(trace_file, "PROGRESS_EVERY_LINES", 100)
    f = tmp_path / "t.csv"
    f.write_text("arrival_s,prompt_tokens,output_tokens\n" + "".join(f"{i},5,2\n" for i in range(450)))
    lines: list[str] = []
    assert len(load_trace(f, limit=10, log=lines.append)) == 10
    assert lines[-1] == f"workload: read 400 lines of {f} (keeping the 10 earliest)" and len(lines) == 4
    with open(f, "ab") as out:
        out.write(b"451,5,\xff\n")  # bad UTF-8 after every kept request: still found, by line
    with pytest.raises(ConfigError, match="is not UTF-8 text \\(invalid byte on line 452"):
        load_trace(f, limit=10, log=lines.append)


def test_a_workload_keeps_only_its_requests_of_a_long_trace(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("arrival_s,prompt_tokens,output_tokens\n" + "".join(f"{1000 - i},7,3\n" for i in range(1000)))
    spec = WorkloadSpec.from_dict({"requests": 5, "arrival": {"type": "trace", "path": str(f)}})
    assert len(spec.trace.records) == 5 and [r.arrival_s for r in spec.trace.records] == [1, 2, 3, 4, 5]
