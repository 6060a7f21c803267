"""Hostile files through every importer (issue 38, items 1, 3, 4, 12, 13): `import vllm-trace`, `vllm-bench`,
`vllm-log`, `calibrate --from-vllm` and `compare --measured` read through one bounded reader
(`core.limits.read_bytes`): a decompression bomb, `/dev/zero`, a FIFO, a folder, 100k-deep JSON and
numbers no float holds end in exit 2 with one line naming the file and the limit, nothing read whole.
Peak memory and time of each case: `benchmarks/import_hostile.py`."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servetwin.core.config_error import ConfigError
from servetwin.core.limits import MAX_IMPORT_FILE_BYTES
from servetwin.experiments.cli import main
from servetwin.experiments.vllm_import.bench_file import load_bench_file
from servetwin.experiments.vllm_import.from_vllm import classify
from servetwin.experiments.vllm_import.profiler_trace import read_profiler_traces
from servetwin.experiments.vllm_import.server_log import parse_server_log, read_server_log

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "tests" / "data" / "vllm_bench" / "er0080_vllm0.25.1_sweep_opt125m_c2_p8_run0.json"
STEP = "execute_context_1(4)_generation_0(0)"


def importers(f: Path, out: Path) -> dict[str, list[str]]:
    exp = out.parent / "exp.yaml"
    exp.write_text("name: e\nmodel: tiny-llama\nhardware: cpu\nbackends: [sim]\n")
    return {"vllm-trace": ["import", "vllm-trace", str(f), "-o", str(out)],
            "vllm-bench": ["import", "vllm-bench", str(f), "-o", str(out), "--hardware", "h100-sxm", "--model", "llama-3.1-8b"],
            "vllm-log": ["import", "vllm-log", str(f)],
            "from-vllm": ["calibrate", "--from-vllm", str(f), "-o", str(out) + ".yaml", "--hardware", "h100-sxm"],
            "measured": ["compare", "--measured", str(f), str(exp)]}


def bomb(path: Path, inflated: int) -> Path:
    """A gzip file of `inflated` zero bytes (about 1/1000 of that on disk), written in chunks."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: the gzip container
    chunk = b"0" * (1 << 20)
    with open(path, "wb") as f:
        for _ in range(inflated // len(chunk)):
            f.write(z.compress(chunk))
        f.write(z.flush())
    return path


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """{case: (file, what the error says)}."""
    d = tmp_path_factory.mktemp("hostile")
    fifo = d / "fifo.json"
    os.mkfifo(fifo)
    zero = d / "zero.json"
    zero.symlink_to("/dev/zero")
    folder = d / "folder.json"
    folder.mkdir()
    deep = d / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    return {"bomb": (bomb(d / "bomb.json.gz", MAX_IMPORT_FILE_BYTES + (8 << 20)),
                     f"inflates to more than the limit of {MAX_IMPORT_FILE_BYTES} bytes"),
            "fifo": (fifo, "is not a regular file"), "dev-zero": (zero, "is not a regular file"),
            "folder": (folder, "is a folder"), "deep": (deep, "nested more than 64 levels")}


@pytest.mark.parametrize("command", ["vllm-trace", "vllm-bench", "vllm-log", "from-vllm", "measured"])
@pytest.mark.parametrize("case", ["bomb", "fifo", "dev-zero", "folder", "deep"])
def test_every_importer_refuses_hostile_files_by_name(hostile, tmp_path, capsys, command, case):
    path, needle = hostile[case]
    if case == "deep" and command == "vllm-log":
        needle = "no vLLM startup line"  # a log is text: its brackets nest nothing
    argv = importers(path, tmp_path / "out")[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert str(path) in err and needle in err, err
    assert not (tmp_path / "out").exists() or command == "vllm-trace" and not any((tmp_path / "out").rglob("*.parquet"))


def test_a_fifo_importer_does_not_hang_in_a_fresh_process(hostile, tmp_path):
    """The FIFO case once more in a subprocess with a deadline: a reader that opens the FIFO blocks forever."""
    path, _ = hostile["fifo"]
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", "servetwin.experiments.cli", "import", "vllm-trace", str(path), "-o",
                        str(tmp_path / "o")], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "is not a regular file" in r.stderr and "Traceback" not in r.stderr


def trace_doc(**event) -> bytes:
    ev = {"ph": "X", "cat": "user_annotation", "name": STEP, "ts": 5, "dur": 7, **event}
    return json.dumps({"traceEvents": [ev]}).encode()


@pytest.mark.parametrize("text,needle", [
    (b'{"traceEvents": [{"ph": "X", "cat": "user_annotation", "name": "' + STEP.encode() + b'", "ts": 5, "dur": '
     + b"1" + b"0" * 400 + b"}]}", "traceEvents[0].dur: must be a finite number in (0, 9.0072e+15], got an integer of 401 digits"),
    (trace_doc(dur=1e300), "traceEvents[0].dur: must be a finite number in (0, 9.0072e+15], got 1e+300"),
    (trace_doc(dur=0), "traceEvents[0].dur: must be a finite number in (0, 9.0072e+15], got 0"),
    (trace_doc(ts=1e308), "traceEvents[0].ts: must be a finite number in [0, 9.0072e+15], got 1e+308"),
    (trace_doc(name="execute_context_99999999999999999999999(1)_generation_0(0)"), "a count over the limit"),
    (b'{"traceEvents": [{"ts": ' + b"9" * 5000 + b"}]}", "an integer of too many digits"),
    (json.dumps({"traceEvents": [{"cat": "user_annotation"}, [], 7]}).encode(), "no execute_context_X(a)"),
    ("\ufeff".encode("utf-16") + b"\x00{", "is not UTF-8 text"),
], ids=["10**400", "1e300", "zero-dur", "ts-1e308", "step-overflow", "5000-digits", "no-ph", "utf-16"])
def test_trace_numbers_are_bounded_before_any_arithmetic(tmp_path, text, needle):
    f = tmp_path / "t.json"
    f.write_bytes(text)
    with pytest.raises(ConfigError, match=None) as err:
        read_profiler_traces([f])
    assert needle in str(err.value) and "t.json" in str(err.value)


def test_overlapping_step_ranges_are_refused(tmp_path):
    events = [{"ph": "X", "cat": "user_annotation", "name": STEP, "ts": ts, "dur": 10} for ts in (0, 5)]
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"traceEvents": events}))
    with pytest.raises(ConfigError, match=r"traceEvents\[1\]\.ts: this step range starts 5.000 us before"):
        read_profiler_traces([f])


def test_a_trace_of_many_events_keeps_only_its_step_ranges(tmp_path):
    """Non-step events (kernels, their args) are dropped as they are parsed."""
    noise = [{"ph": "X", "cat": "kernel", "name": "k", "ts": i, "dur": 1, "args": {"grid": [1, 2, 3]}}
             for i in range(20_000)]
    steps = [{"ph": "X", "cat": "user_annotation", "name": STEP, "ts": 100 * i, "dur": 50, "args": {"x": 1}}
             for i in range(30)]
    f = tmp_path / "t.json.gz"
    f.write_bytes(gzip.compress(json.dumps({"traceEvents": noise + steps}).encode()))
    table = read_profiler_traces([f])
    assert len(table) == 30 and np.allclose(table.duration_s, 50e-6) and (table.gap_before_s.iloc[1:] > 0).all()


@pytest.mark.parametrize("field,value,needle", [
    ("completed", 1e12, "completed: must be a finite number in [0, 1e+07], got 1000000000000.0"),
    ("request_rate", 1e-300, "request_rate: must be a finite number in [1e-06, 1e+09], got 1e-300"),
    ("input_lens", [10 ** 15], "input_lens[0]: must be an integer in [0, 16777216]"),
    ("duration", 10 ** 400, "duration: must be a finite number in [0, 9.0072e+15], got an integer of 401 digits"),
])
def test_bench_figures_are_bounded_and_name_file_and_field(tmp_path, field, value, needle):
    doc = json.loads(BENCH.read_text())
    if field == "input_lens":
        doc.update(output_lens=[1], ttfts=[0.1], errors=[""])
    doc[field] = value
    f = tmp_path / "b.json"
    f.write_text(json.dumps(doc))
    with pytest.raises(ConfigError) as err:
        load_bench_file(f)
    assert "b.json" in str(err.value) and needle in str(err.value), str(err.value)


def test_a_5000_digit_bench_number_names_file_and_limit(tmp_path, capsys):
    text = BENCH.read_text().replace('"completed": ', '"completed": ' + "9" * 5000 + ', "was": ', 1)
    f = tmp_path / "b.json"
    f.write_text(text)
    assert main(["import", "vllm-bench", str(f), "-o", str(tmp_path / "o"), "--hardware", "h100-sxm"]) == 2
    err = capsys.readouterr().err
    assert "b.json" in err and "too many digits" in err and "Traceback" not in err


def test_a_long_repeated_log_line_is_parsed_in_linear_time():
    """The old `Capturing CUDA graphs? \\((...)\\).*?\\|` tried every repeat to the end of the line: 4 MB
    lines of each hostile repeat would take hours; a 60 s deadline is a hang guard, not a timing."""
    code = ("from servetwin.experiments.vllm_import.server_log import parse_server_log\n"
            "for unit in ('Capturing CUDA graphs (', 'Capturing CUDA graphs (a) ', \"with config: model='\", "
            "'non-default args: {', \"'cudagraph_capture_sizes': [1,\"):\n"
            "    parse_server_log(unit * (4_000_000 // len(unit)))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ})
    assert r.returncode == 0, r.stderr


def test_log_values_are_echoed_with_control_characters_escaped(tmp_path, capsys):
    f = tmp_path / "v.log"
    f.write_text("INFO vLLM API server version 0.9\x1b]0;pwned\x07\x1b[2J\n"
                 "INFO non-default args: {'model': 'm\\x1b[2J', 'max_num_seqs': 8}\n")
    assert main(["import", "vllm-log", str(f)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\\x1b]0;pwned\\x07" in out and "m\\x1b[2J" in out


def test_log_numbers_past_their_digits_are_an_error_naming_the_line():
    with pytest.raises(ConfigError, match=r"x.log:2: kv_cache_tokens: a number of 5000 characters"):
        parse_server_log("x\nGPU KV cache size: " + "9" * 5000 + " tokens\n", "x.log")


def test_from_vllm_on_a_fifo_names_it_without_reading(hostile):
    path, _ = hostile["fifo"]
    with pytest.raises(ConfigError, match="is not a regular file"):
        classify([str(path)])


# -- the property: any file, any importer -> a result or a ConfigError naming the file ------------------
def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


_numbers = st.one_of(st.integers(min_value=-10 ** 500, max_value=10 ** 500), st.floats(allow_nan=True),
                     st.sampled_from(["Infinity", "-Infinity", "NaN", "1e400", "-0", "1" * 4400]))
_contents = st.one_of(
    st.binary(max_size=3000),
    st.builds(lambda d: _nested(d).encode(), st.integers(0, 120_000)),
    st.builds(lambda n, k: json.dumps({"traceEvents": [{"ph": "X", "cat": "user_annotation", "name": STEP,
                                                        "ts": 0, "dur": 1, k: "@"}]}).replace('"@"', str(n)).encode(),
              _numbers, st.sampled_from(["ts", "dur"])),
    st.builds(lambda n, k: json.dumps({**json.loads(BENCH.read_text()), k: "@"}).replace('"@"', str(n)).encode(),
              _numbers, st.sampled_from(["completed", "request_rate", "duration", "num_prompts", "max_concurrency"])),
    st.builds(lambda t, enc: t.encode(enc, errors="replace"),
              st.text(max_size=300), st.sampled_from(["utf-8", "utf-16", "utf-32", "latin-1", "utf-8-sig"])),
)
_readers = {"trace": lambda p: read_profiler_traces([p]), "bench": load_bench_file, "log": read_server_log,
            "classify": lambda p: classify([str(p)])}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(content=_contents, gz=st.booleans(), kind=st.sampled_from(["file", "folder", "fifo", "dev-null"]),
       reader=st.sampled_from(sorted(_readers)))
def test_importers_give_a_result_or_an_error_naming_the_file(tmp_path_factory, content, gz, kind, reader):
    d = tmp_path_factory.mktemp("h")
    path = d / "in.json"
    if kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-null":
        path.symlink_to("/dev/null")
    else:
        path.write_bytes(gzip.compress(content) if gz else content)
    try:
        _readers[reader](path)
    except ConfigError as e:
        assert str(path) in str(e) or path.name in str(e), str(e)
        assert kind == "file" or "regular file" in str(e) or "folder" in str(e)
    else:
        assert kind == "file"


# -- item 11: published.json written once; an interrupted import leaves the folder marked -----------------
def _jsonl(tmp_path: Path, n: int) -> Path:
    line = json.dumps(json.loads(BENCH.read_text()))
    f = tmp_path / "many.jsonl"
    f.write_text((line + "\n") * n)
    return f


def test_published_json_is_written_once_for_all_cases(tmp_path, capsys, monkeypatch):
    from servetwin.experiments.vllm_import import bench_case

    calls = []
    real = bench_case.write_published
    monkeypatch.setattr(bench_case, "write_published", lambda *a: calls.append(1) or real(*a))
    out = tmp_path / "o"
    argv = ["import", "vllm-bench", str(_jsonl(tmp_path, 40)), "-o", str(out), "--hardware", "h100-sxm", "--model", "llama-3.1-8b"]
    assert main(argv) == 0
    assert calls == [1] and len(json.loads((out / "published.json").read_text())) == 40
    assert not (out / bench_case.IMPORT_INCOMPLETE_MARKER).exists()
    assert "(40/40)" in capsys.readouterr().err  # a progress count on each case


def test_sigterm_mid_import_leaves_the_folder_marked_and_validate_refuses_it(tmp_path):
    import signal
    import time

    from servetwin.experiments.validate.published import IMPORT_INCOMPLETE_MARKER

    out = tmp_path / "o"
    proc = subprocess.Popen([sys.executable, "-m", "servetwin.experiments.cli", "import", "vllm-bench",
                             str(_jsonl(tmp_path, 3000)), "-o", str(out), "--hardware", "h100-sxm", "--model", "llama-3.1-8b"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(list((out / "cases").glob("*.yaml"))) < 3:  # some cases written, the import still going
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    assert (out / IMPORT_INCOMPLETE_MARKER).exists() and not (out / "published.json").exists()
    r = subprocess.run([sys.executable, "-m", "servetwin.experiments.cli", "validate", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and IMPORT_INCOMPLETE_MARKER in r.stderr and "Traceback" not in r.stderr


def test_a_trace_of_more_step_ranges_than_the_limit_is_refused(tmp_path, monkeypatch):
    from servetwin.experiments.vllm_import import profiler_trace

    monkeypatch.setattr(profiler_trace, "MAX_TRACE_STEPS", 10)
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "user_annotation", "name": STEP, "ts": 100 * i,
                                              "dur": 50} for i in range(11)]}))
    with pytest.raises(ConfigError, match="t.json holds 11 steps, more than the limit of 10"):
        read_profiler_traces([f])
    f.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "user_annotation", "name": STEP, "ts": 100 * i,
                                              "dur": 50} for i in range(25)]}))
    with pytest.raises(ConfigError, match="t.json holds more than 10 steps"):  # stopped while parsing
        read_profiler_traces([f])


def test_a_large_trace_reports_progress(tmp_path, monkeypatch):
    from servetwin.experiments.vllm_import import profiler_trace

    monkeypatch.setattr(profiler_trace, "PROGRESS_EVERY_STEPS", 10)
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "user_annotation", "name": STEP, "ts": 100 * i,
                                              "dur": 50} for i in range(25)]}))
    lines: list[str] = []
    assert len(read_profiler_traces([f], log=lines.append)) == 25
    assert lines == [f"trace: {f}: 25 step ranges read", "trace: 10/25 step rows built", "trace: 20/25 step rows built"]
