"""Run folders never lie: atomic files, summary last, one writer, no stale files, failed runs touch nothing."""
import contextlib
import errno
import json
import os
import pathlib

import pytest
from exptest_helpers import folder_tree, tiny, write_yaml

from servetwin.core.testbed import atomic
from servetwin.core.testbed.atomic import atomic_open, atomic_write_with, staged_folder
from servetwin.experiments.cli import main
from servetwin.experiments.run.run_folder import MARKER, RunFolder
from servetwin.experiments.config.schema import ConfigError


# -- the atomic helpers -----------------------------------------------------------------------------
def test_atomic_open_on_a_full_disk_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "trace.json"
    target.write_text("old complete file")
    with pytest.raises(OSError) as info:
        with atomic_open(str(target)) as f:
            f.write('{"traceEvents": [{"na')  # half written, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
    assert info.value.errno == errno.ENOSPC
    assert target.read_text() == "old complete file"
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]


def test_atomic_write_with_interrupted_writer_leaves_nothing(tmp_path):
    def writer(tmp):
        with open(tmp, "w") as f:
            f.write("partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write_with(str(tmp_path / "steps.parquet"), writer)
    assert list(tmp_path.iterdir()) == []


def test_staged_folder_moves_complete_files_only(tmp_path):
    with staged_folder(str(tmp_path)) as stage:
        (open(os.path.join(stage, "a.png"), "w")).close()
    assert [p.name for p in tmp_path.iterdir()] == ["a.png"]
    with pytest.raises(KeyboardInterrupt):
        with staged_folder(str(tmp_path)) as stage:
            open(os.path.join(stage, "b.png"), "w").close()
            raise KeyboardInterrupt
    assert [p.name for p in tmp_path.iterdir()] == ["a.png"]


# -- the run folder ---------------------------------------------------------------------------------
def test_full_disk_while_writing_trace_json_leaves_no_truncated_trace(tmp_path, monkeypatch, capsys):
    import servetwin.core.testbed.perfetto as perfetto

    class FillingFile:  # the disk fills up after trace.json's first two writes (it is streamed)
        def __init__(self, f):
            self.f, self.writes = f, 0

        def write(self, text):
            self.writes += 1
            if self.writes > 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(text)

    @contextlib.contextmanager
    def filling_open(path, *args, **kwargs):
        with atomic.atomic_open(path, *args, **kwargs) as f:
            yield FillingFile(f)

    monkeypatch.setattr(perfetto, "atomic_open", filling_open)
    path = write_yaml(tmp_path / "c.yaml", tiny())
    out = tmp_path / "out"
    assert main(["run", str(path), "-o", str(out), "--no-progress", "--no-plots"]) == 1
    assert "No space left on device" in capsys.readouterr().err
    files = folder_tree(out)
    assert "sim/trace.json" not in files and "summary.json" not in files  # no summary vouches for it
    assert not [n for n in files if atomic.TMP_MARK in n]
    for name, data in files.items():  # what is there is complete
        if name.endswith(".parquet"):
            import pandas as pd
            pd.read_parquet(out / name)


def test_ctrl_c_while_writing_the_report_leaves_no_summary_and_says_so(tmp_path, monkeypatch, capsys):
    import servetwin.experiments.run.report as report

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "write_report", interrupted)
    path = write_yaml(tmp_path / "c.yaml", tiny())
    out = tmp_path / "out"
    assert main(["run", str(path), "-o", str(out), "--no-progress", "--no-plots"]) == 130
    err = capsys.readouterr().err
    assert "has no summary.json" in err and "partial results" not in err
    names = set(folder_tree(out))
    assert "summary.json" not in names and "sim/summary.json" in names


def test_a_second_run_into_a_locked_folder_fails_naming_the_flag(tmp_path, capsys):
    path = write_yaml(tmp_path / "c.yaml", tiny())
    out = tmp_path / "out"
    with RunFolder(str(out)):  # another run holds it (a separate lock, as another process would)
        assert main(["run", str(path), "-o", str(out), "--no-progress", "--no-plots", "--overwrite"]) == 2
        err = capsys.readouterr().err
        assert "-o/--output:" in err and "another run" in err
        assert list(out.iterdir()) == []
    assert main(["run", str(path), "-o", str(out), "--no-progress", "--no-plots"]) == 0  # released


def test_a_failed_run_leaves_an_existing_folder_untouched(tmp_path, monkeypatch, capsys):
    import servetwin.experiments.run.runner as runner

    path = write_yaml(tmp_path / "c.yaml", tiny())
    out = tmp_path / "out"
    assert main(["run", str(path), "-o", str(out), "--no-progress"]) == 0
    before = folder_tree(out)

    def bad_engine(exp, backend):
        raise ConfigError("engine.num_gpu_blocks", "too small for one request [sim backend]")

    monkeypatch.setattr(runner, "create_engine", bad_engine)
    assert main(["run", str(path), "-o", str(out), "--no-progress", "--overwrite"]) == 2
    assert "engine.num_gpu_blocks" in capsys.readouterr().err
    assert folder_tree(out) == before
    fresh = tmp_path / "fresh"
    assert main(["run", str(path), "-o", str(fresh), "--no-progress"]) == 2
    assert not fresh.exists()  # a folder this run created is removed again


def test_summary_is_written_last(tmp_path, monkeypatch):
    import servetwin.experiments.run.run_folder as rf

    order = []
    real = rf.RunFolder.record

    def done(self, rel):
        order.append(rel)
        return real(self, rel)

    monkeypatch.setattr(rf.RunFolder, "record", done)
    path = write_yaml(tmp_path / "c.yaml", tiny())
    assert main(["run", str(path), "-o", str(tmp_path / "out"), "--no-progress"]) == 0
    assert order[0] == "config.yaml" and order[-1] == "summary.json" and order.count("summary.json") == 1
    assert "report.md" in order and "sim/summary.json" in order
    assert set(folder_tree(tmp_path / "out")) >= {"config.yaml", "report.md", "summary.json", "sim/trace.json",
                                             "sim/steps.parquet", "sim/summary.json"}


def test_sweep_refuses_a_non_empty_folder_and_overwrite_clears_its_old_points(tmp_path, capsys):
    out = tmp_path / "out"
    three = write_yaml(tmp_path / "c3.yaml", tiny(sweep={"engine.max_num_seqs": [2, 4, 8]}, workload__requests=3))
    assert main(["sweep", str(three), "-o", str(out), "--no-progress", "--no-plots"]) == 0
    stale = {p.name for p in out.iterdir() if p.is_dir()}
    path = write_yaml(tmp_path / "c.yaml", tiny(sweep={"engine.max_num_seqs": [16]}, workload__requests=3))
    assert main(["sweep", str(path), "-o", str(out), "--no-progress", "--no-plots"]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert main(["sweep", str(path), "-o", str(out), "--no-progress", "--no-plots", "--overwrite"]) == 0
    names = {p.name for p in out.iterdir()}
    assert not stale & names and {"sweep.csv", "sweep.md", "config.yaml"} <= names  # old points gone
    assert "<backend>" not in capsys.readouterr().out
    assert set(folder_tree(out)) <= _marked(out)  # every file the sweep and its points wrote is listed


# -- --overwrite clears only what servetwin wrote -----------------------------------------------------
def _marked(out) -> set[str]:
    """Every path the folder's markers (its own and its subfolders') list, the markers included."""
    found = set()
    for folder, _, files in os.walk(out):
        if MARKER in files:
            rel = os.path.relpath(folder, out)
            found.add(os.path.normpath(os.path.join(rel, MARKER)))
            lines = (pathlib.Path(folder) / MARKER).read_text().splitlines()
            found |= {os.path.normpath(os.path.join(rel, ln)) for ln in lines if ln and not ln.startswith("#")}
    return found


def _run(cfg, out, *extra):
    return main(["run", str(cfg), "-o", str(out), "--no-progress", *extra])


def test_overwrite_refuses_a_folder_servetwin_did_not_write(tmp_path, capsys):
    cfg = write_yaml(tmp_path / "c.yaml", tiny())
    repo = tmp_path / "repo"
    (repo / ".git" / "objects").mkdir(parents=True)
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (repo / "notes.txt").write_text("mine")
    (repo / "summary.json").write_text("{}")  # a servetwin-looking name changes nothing
    before = folder_tree(repo)
    assert _run(cfg, repo, "--overwrite") == 2
    err = capsys.readouterr().err
    assert "-o/--output:" in err and str(repo) in err and "not written by servetwin" in err
    assert "notes.txt" in err and "Traceback" not in err
    assert folder_tree(repo) == before


def test_overwrite_of_the_current_folder_is_refused(tmp_path, monkeypatch, capsys):
    cfg = write_yaml(tmp_path / "c.yaml", tiny())
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "analysis.py").write_text("print(1)")
    monkeypatch.chdir(scratch)
    assert _run(cfg, ".", "--overwrite") == 2
    assert "not written by servetwin" in capsys.readouterr().err
    assert [p.name for p in scratch.iterdir()] == ["analysis.py"]


def test_overwrite_keeps_a_user_file_inside_an_old_run_folder(tmp_path):
    out = tmp_path / "out"
    assert _run(write_yaml(tmp_path / "two.yaml", tiny(backends=["sim"])), out) == 0
    first = set(folder_tree(out))
    (out / "analysis.ipynb").write_text('{"cells": []}')
    (out / "sim" / "my_plot.png").write_bytes(b"mine")  # even a kind servetwin writes, when it did not
    assert _run(write_yaml(tmp_path / "c.yaml", tiny(output={"plots": False})), out, "--overwrite") == 0
    after = folder_tree(out)
    assert after["analysis.ipynb"] == b'{"cells": []}' and after["sim/my_plot.png"] == b"mine"
    assert set(after) - {"analysis.ipynb", "sim/my_plot.png"} <= _marked(out)
    assert {"analysis.ipynb", "sim/my_plot.png"}.isdisjoint(_marked(out))
    stale = {f for f in first if f.endswith(".png")}
    assert stale and stale.isdisjoint(after)  # the first run's figures went (this one drew none)


def test_overwrite_of_a_folder_from_before_the_marker(tmp_path, capsys):
    cfg = write_yaml(tmp_path / "c.yaml", tiny(output={"plots": False}))
    out = tmp_path / "old"
    assert _run(cfg, out) == 0
    (out / MARKER).unlink()  # as the version before the marker left it
    (out / "notebook.ipynb").write_text("{}")
    before = folder_tree(out)
    assert _run(cfg, out, "--overwrite") == 2  # holds a file servetwin never writes: refused
    assert "notebook.ipynb" in capsys.readouterr().err and folder_tree(out) == before
    (out / "notebook.ipynb").unlink()
    (out / "sim" / "stale.parquet").write_bytes(b"old")
    assert _run(cfg, out, "--overwrite") == 0  # only servetwin's kinds of file: cleared
    assert "sim/stale.parquet" not in folder_tree(out) and (out / MARKER).exists()


def test_overwrite_through_a_symlink_applies_the_rules_to_the_target(tmp_path, capsys):
    cfg = write_yaml(tmp_path / "c.yaml", tiny(output={"plots": False}))
    target = tmp_path / "home"
    target.mkdir()
    (target / ".bashrc").write_text("export A=1")
    link = tmp_path / "link"
    link.symlink_to(target)
    assert _run(cfg, link, "--overwrite") == 2
    err = capsys.readouterr().err
    assert "not written by servetwin" in err and f"-> {target}" in err and ".bashrc" in err
    assert [p.name for p in target.iterdir()] == [".bashrc"]
    run_target = tmp_path / "run_target"
    assert _run(cfg, run_target) == 0
    (run_target / "keep.txt").write_text("mine")
    link.unlink()
    link.symlink_to(run_target)
    assert _run(cfg, link, "--overwrite") == 0
    assert link.is_symlink() and (run_target / "keep.txt").read_text() == "mine"
    assert (run_target / "summary.json").exists()


def test_a_marker_cannot_reach_outside_its_folder(tmp_path):
    cfg = write_yaml(tmp_path / "c.yaml", tiny(output={"plots": False}))
    out = tmp_path / "out"
    assert _run(cfg, out) == 0
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    with open(out / MARKER, "a") as f:
        f.write(f"../victim.txt\n{victim}\n")
    assert _run(cfg, out, "--overwrite") == 0
    assert victim.read_text() == "keep me"


# -- issue 38 items 9, 10, 13: files listed before they are written; hostile markers --------------------
def test_an_interrupted_output_phase_lists_every_file_it_left(tmp_path, monkeypatch, capsys):
    """Interrupted after the tables and figures (the report raises): each file on disk is already in the
    marker, so a later --overwrite without figures leaves none of the first run's PNGs."""
    import servetwin.experiments.run.report as report

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "write_report", interrupted)
    cfg = write_yaml(tmp_path / "c.yaml", tiny())
    out = tmp_path / "out"
    assert _run(cfg, out) == 130
    left = set(folder_tree(out))
    assert any(f.endswith(".png") for f in left) and any(f.endswith(".parquet") for f in left)
    assert left <= _marked(out), left - _marked(out)
    monkeypatch.undo()
    assert _run(write_yaml(tmp_path / "n.yaml", tiny(output={"plots": False})), out, "--overwrite") == 0
    assert not any(f.endswith(".png") for f in folder_tree(out))
    capsys.readouterr()


def test_an_announced_write_is_listed_before_its_file_appears(tmp_path, monkeypatch):
    seen = []
    real_replace = os.replace

    def replace(tmp, final):  # what the marker says at the moment of the rename
        seen.append((tmp_path / "o" / MARKER).read_text().splitlines()[-1])
        real_replace(tmp, final)
    with RunFolder(str(tmp_path / "o")) as folder:
        folder.begin()
        (tmp_path / "o" / "sub").mkdir()
        monkeypatch.setattr(os, "replace", replace)
        atomic_write_with(str(tmp_path / "o" / "sub" / "x.txt"), lambda tmp: pathlib.Path(tmp).write_text("x"))
        monkeypatch.undo()
    assert seen == [os.path.join("sub", "x.txt")]


@pytest.mark.parametrize("kind", ["dev-zero", "fifo"])
def test_a_marker_that_is_no_regular_file_is_refused(tmp_path, capsys, kind):
    cfg = write_yaml(tmp_path / "c.yaml", tiny(output={"plots": False}))
    out = tmp_path / "out"
    assert _run(cfg, out) == 0
    (out / MARKER).unlink()
    if kind == "fifo":
        os.mkfifo(out / MARKER)
    else:
        (out / MARKER).symlink_to("/dev/zero")
    assert _run(cfg, out, "--overwrite") == 2
    err = capsys.readouterr().err
    assert f"{MARKER} is not a regular file" in err and "Traceback" not in err
    assert (out / "summary.json").exists()  # nothing removed


def test_a_marker_of_many_entries_shows_progress(tmp_path, capsys):
    cfg = write_yaml(tmp_path / "c.yaml", tiny(output={"plots": False}))
    out = tmp_path / "out"
    assert _run(cfg, out) == 0
    with open(out / MARKER, "a") as f:
        f.writelines(f"gone/{i}.parquet\n" for i in range(45_000))
    assert _run(cfg, out, "--overwrite") == 0
    assert "--overwrite: removed 40,000/" in capsys.readouterr().err
