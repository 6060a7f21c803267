"""Run folders never lie: atomic files, summary last, one writer, no stale files, failed runs touch nothing."""
import errno
import json
import os

import pytest
from exptest_helpers import folder_tree, tiny, write_yaml

from servetwin.core.testbed import atomic
from servetwin.core.testbed.atomic import atomic_open, atomic_write_with, staged_folder
from servetwin.experiments.cli import main
from servetwin.experiments.run_folder import RunFolder
from servetwin.experiments.schema import ConfigError


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

    def write_text(path, text):  # the disk fills up half-way through trace.json
        with atomic.atomic_open(path) as f:
            f.write(text[: len(text) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(perfetto, "atomic_write_text", write_text)
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
    import servetwin.experiments.report as report

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
    import servetwin.experiments.runner as runner

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
    import servetwin.experiments.run_folder as rf

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


def test_sweep_refuses_a_non_empty_folder_and_overwrite_clears_it(tmp_path, capsys):
    path = write_yaml(tmp_path / "c.yaml", tiny(sweep={"engine.max_num_seqs": [2, 4]}, workload__requests=3))
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale_point").mkdir()
    assert main(["sweep", str(path), "-o", str(out), "--no-progress", "--no-plots"]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert main(["sweep", str(path), "-o", str(out), "--no-progress", "--no-plots", "--overwrite"]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert "stale_point" not in names and {"sweep.csv", "sweep.md", "config.yaml"} <= set(names)
    assert "<backend>" not in capsys.readouterr().out
