"""Hostile files through the command line (issue 27, items 2, 7, 9-13): each ends in exit 2 with one line
naming the field or file, before anything large is allocated, without echoing the file's content.
Large files are sparse (no disk used). Peak memory and time per case: `benchmarks/server_hostile.py`."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from exptest_helpers import tiny, write_yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servetwin.core.config_error import ConfigError
from servetwin.experiments.cli import main
from servetwin.sim.trace_file import load_trace

REPO = Path(__file__).resolve().parents[2]
SETTINGS = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "num_gpu_blocks": 64, "block_size": 16}


def fails_naming(capsys, argv: list[str], *needles: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def bomb(levels: int = 9, fanout: int = 9) -> str:
    lines = [f"l0: &l0 [{', '.join(['x'] * fanout)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * fanout)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def sparse(path: Path, size: int, head: bytes) -> Path:
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)
    return path


def with_trace(tmp_path: Path, trace: Path, fmt: str = "auto") -> Path:
    arrival = {"type": "trace", "path": str(trace), **({"format": fmt} if fmt != "auto" else {})}
    return write_yaml(tmp_path / "t.yaml", {**tiny(), "workload": {"arrival": arrival}})


# -- item 2: alias bombs; item 10/11: YAML nesting, encodings, digits --------------------------------
@pytest.mark.parametrize("command,key", [("run", "seed"), ("run", "name"), ("sweep", "sweep"),
                                         ("run", "engine")])
def test_alias_bomb_is_refused_before_it_is_built(tmp_path, capsys, command, key):
    cfg = write_yaml(tmp_path / "c.yaml", {k: v for k, v in tiny().items() if k != key})
    cfg.write_text(bomb() + cfg.read_text() + f"{key}: *l8\n")
    out = tmp_path / "out"
    err = fails_naming(capsys, [command, str(cfg), "-o", str(out), "--no-progress"], "config:", "expands to more than")
    assert "'x'" not in err and not out.exists()  # nothing half-written, the value never formatted


@pytest.mark.parametrize("text,needle", [
    ("a: " + "[" * 100_000 + "]" * 100_000 + "\n", "nested more than 64 levels"),
    ("seed: " + "9" * 5000 + "\n", "too many digits"),
    (b"model: caf\xe9\n", "is not UTF-8 text (invalid byte at offset 10"),
    (b"\x00\x01\xff" * 100, "is not UTF-8 text"),
], ids=["deep", "digits", "latin-1", "binary"])
def test_bad_yaml_text_is_an_error_naming_the_file(tmp_path, capsys, text, needle):
    cfg = tmp_path / "c.yaml"
    cfg.write_bytes(text if isinstance(text, bytes) else text.encode())
    fails_naming(capsys, ["run", str(cfg), "-o", str(tmp_path / "out")], f"config: {cfg}", needle)


# -- item 9/11: model files ---------------------------------------------------------------------------
def test_model_paths_that_are_no_model_config_name_the_field(tmp_path, capsys):
    big = tmp_path / "big"
    big.mkdir()
    sparse(big / "config.json", 3 << 30, b"{")
    for model, needle in (("/etc/passwd", "is not valid JSON"), ("/proc/self/mem", "is not a regular file"),
                          (str(big), "is 3221225472 bytes, more than the limit")):
        cfg = write_yaml(tmp_path / "c.yaml", tiny(model=model))
        fails_naming(capsys, ["run", str(cfg), "-o", str(tmp_path / "out")], "error: model: ", needle)


# -- item 9/10/12/13: traces ----------------------------------------------------------------------------
def test_trace_files_fail_before_allocation_naming_the_line(tmp_path, capsys):
    cases = [
        (sparse(tmp_path / "big.csv", 3 << 30, b"arrival_s,prompt_tokens,output_tokens\n"), "auto",
         "workload.arrival.path: ", "more than the limit of"),
        (tmp_path / "moon.jsonl", "mooncake", "moon.jsonl:1.input_length: 10000000000 tokens", "limit"),
        (tmp_path / "deep.jsonl", "auto", "deep.jsonl:1: this line is nested more than 64", ""),
        (tmp_path / "field.csv", "auto", "field.csv:", "field larger than field limit"),
        (tmp_path / "bin.csv", "auto", "is not UTF-8 text (invalid byte on line 2", ""),
    ]
    cases[1][0].write_text(json.dumps({"timestamp": 0, "input_length": 10 ** 10, "output_length": 4,
                                       "hash_ids": [1]}) + "\n")
    cases[2][0].write_text("[" * 100_000 + "]" * 100_000 + "\n")
    cases[3][0].write_text("arrival_s,prompt_tokens,output_tokens\n0,8," + "4" * 200_000 + "\n")
    cases[4][0].write_bytes(b"arrival_s,prompt_tokens,output_tokens\n\xff\xfe\x00")  # read line by line: a full header
    for trace, fmt, *needles in cases:
        fails_naming(capsys, ["run", str(with_trace(tmp_path, trace, fmt)), "-o", str(tmp_path / "out")],
                     *[n for n in needles if n])


def test_a_non_trace_file_is_not_echoed(tmp_path, capsys):
    secret = tmp_path / "secrets.txt"
    secret.write_text("AWS_SECRET_ACCESS_KEY=abc123/xyz\nTOKEN=hunter2\n")
    for path in (secret, Path("/proc/self/environ")):
        cfg = write_yaml(tmp_path / "c.yaml", {**tiny(), "workload": {"file": str(path)}})
        err = fails_naming(capsys, ["run", str(cfg), "-o", str(tmp_path / "out")], "workload")
        assert "abc123" not in err and "hunter2" not in err and "PATH=" not in err and "HOME=" not in err


def test_a_csv_with_a_utf8_bom_is_read(tmp_path):
    trace = tmp_path / "bom.csv"
    trace.write_bytes(b"\xef\xbb\xbfarrival_s,prompt_tokens,output_tokens\n0,8,4\n0.5,9,3\n")
    assert [r.prompt_tokens for r in load_trace(trace)] == [8, 9]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(depth=st.integers(0, 3000), tokens=st.sampled_from([1, 8, 10 ** 7, 10 ** 10, 10 ** 30]),
       encoding=st.sampled_from(["utf-8", "utf-8-sig", "utf-16", "latin-1"]), suffix=st.sampled_from([".csv", ".jsonl"]))
def test_any_trace_is_records_or_a_config_error(tmp_path, depth, tokens, encoding, suffix):
    """A trace of any nesting, token count and encoding: its records (within the limits) or a ConfigError
    naming the trace; never RecursionError, MemoryError, UnicodeDecodeError or csv.Error."""
    text = ('{"arrival_s": 0, "prompt_tokens": %d, "output_tokens": 2, "x": %s}\n' % (tokens, "[" * depth + "1"
                                                                                      + "]" * depth)
            if suffix == ".jsonl" else "arrival_s,prompt_tokens,output_tokens,x\n0,%d,2,%s\n" % (tokens, "é" * depth))
    trace = tmp_path / f"t{suffix}"
    trace.write_bytes(text.encode(encoding))
    try:
        records = load_trace(trace)
    except ConfigError as e:
        assert str(trace) in str(e)
        return
    assert trace.read_bytes().decode("utf-8-sig") == text  # read only what is UTF-8 (ASCII latin-1 is)
    assert records[0].prompt_tokens == tokens <= 1 << 24
    assert suffix == ".csv" or depth + 1 <= 64  # the row object is one level


# -- item 9/10/13: scenarios; item 7: replay output ------------------------------------------------
def scenario(tmp_path: Path, data, name: str = "s.json") -> str:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(p)


def test_scenario_files_fail_naming_the_field(tmp_path, capsys):
    huge = {"settings": SETTINGS, "requests": [{"id": "a", "prompt_len": 10 ** 8, "max_tokens": 2}]}
    fails_naming(capsys, ["replay", scenario(tmp_path, huge)], "requests[0].prompt_len: must be an integer in [1, ")
    capped = {"settings": {**SETTINGS, "max_model_len": 128}, "requests": [{"id": "a", "prompt_len": 128}]}
    fails_naming(capsys, ["replay", scenario(tmp_path, capped)], "requests[0].prompt_len", "[1, 127]")
    fails_naming(capsys, ["replay", scenario(tmp_path, "[" * 100_000 + "]" * 100_000)], "nested more than 64")
    fails_naming(capsys, ["replay", scenario(tmp_path, '{"settings": {}, "settings": {}, "requests": []}')],
                 "duplicate key 'settings'")
    fails_naming(capsys, ["replay", "/proc/self/environ"], "scenario: ", "is not a regular file")


def test_replay_output_is_bounded_and_tilde_expanded(tmp_path, capsys, monkeypatch):
    s = scenario(tmp_path, {"settings": {**SETTINGS, "max_steps": 10 ** 9},
                            "requests": [{"id": "a", "prompt_len": 8, "max_tokens": 4, "arrival_step": 10 ** 9 - 1}]})
    monkeypatch.setenv("HOME", str(tmp_path))
    fails_naming(capsys, ["replay", s, "-o", "~/out.jsonl", "--max-output-bytes", "100000"], "--max-output-bytes")
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # the partial file removed
    fails_naming(capsys, ["replay", s, "--max-output-bytes", "100000"], "--max-output-bytes")  # stdout: same bound
    ok = scenario(tmp_path, {"settings": SETTINGS, "requests": [{"id": "a", "prompt_len": 8, "max_tokens": 4}]})
    assert main(["replay", ok, "-o", "~/out.jsonl"]) == 0
    assert (tmp_path / "out.jsonl").is_file() and not (tmp_path / "~").exists()


def test_sigterm_during_replay_exits_143_and_leaves_no_temp_file(tmp_path):
    s = scenario(tmp_path, {"settings": {**SETTINGS, "max_steps": 10 ** 9},
                            "requests": [{"id": "a", "prompt_len": 8, "max_tokens": 4, "arrival_step": 10 ** 9 - 1}]})
    out = tmp_path / "out.jsonl"
    env = dict(os.environ, PYTHONPATH=str(REPO.parent))
    proc = subprocess.Popen([sys.executable, "-m", "servetwin.experiments.cli", "replay", s, "-o", str(out)],
                            cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]:  # writing has begun
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143 and "terminated" in err and "Traceback" not in err, err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
