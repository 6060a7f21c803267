"""`servetwin capacity -o DIR` follows the run-folder protocol: one writer, no stale files, capacity.json last."""
import json

import pytest
from exptest_helpers import folder_tree, tiny, write_yaml

from servetwin.core.testbed import atomic
from servetwin.experiments.cli import main
from servetwin.experiments.run.run_folder import MARKER, RunFolder

ARGS = ["--slo", "ttft_p90_s=0.03", "--seeds", "1", "--tol", "0.3", "--max-probes", "6", "--no-progress"]


def _cfg(tmp_path):
    return write_yaml(tmp_path / "c.yaml", tiny(workload__requests=20, engine__max_num_seqs=4,
                                                workload__arrival={"type": "poisson", "rate": 20.0}))


def test_capacity_refuses_a_non_empty_folder_and_overwrite_clears_stale_files(tmp_path, capsys):
    path, out = _cfg(tmp_path), tmp_path / "cap"
    out.mkdir()
    (out / "config.yaml").write_text("name: old\n")  # an earlier servetwin's folder (before the marker)
    (out / "old.png").write_text("from an earlier run")
    before = folder_tree(out)
    assert main(["capacity", str(path), "-o", str(out), *ARGS, "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert "-o/--output:" in err and "not empty" in err and "--overwrite" in err
    assert folder_tree(out) == before
    assert main(["capacity", str(path), "-o", str(out), *ARGS, "--no-plots", "--overwrite"]) == 0
    names = set(folder_tree(out))
    assert names == {"config.yaml", "probes.csv", "capacity.md", "capacity.json", MARKER}  # old.png is gone
    assert json.loads((out / "capacity.json").read_text())["interrupted"] is False
    assert "wrote" in capsys.readouterr().out


def test_capacity_into_a_locked_folder_fails_naming_the_flag(tmp_path, capsys):
    path, out = _cfg(tmp_path), tmp_path / "cap"
    with RunFolder(str(out)):  # another run holds it
        assert main(["capacity", str(path), "-o", str(out), *ARGS, "--overwrite"]) == 2
        err = capsys.readouterr().err
        assert "-o/--output:" in err and "another run" in err
        assert list(out.iterdir()) == []


def test_a_failed_capacity_run_leaves_an_existing_folder_untouched(tmp_path, capsys):
    path, out = _cfg(tmp_path), tmp_path / "cap"
    assert main(["capacity", str(path), "-o", str(out), *ARGS]) == 0
    before = folder_tree(out)
    assert "capacity.png" in before
    # a bad flag is found after the folder is locked: nothing of the old answer may change
    assert main(["capacity", str(path), "-o", str(out), *ARGS, "--overwrite", "--confidence", "2"]) == 2
    assert "--confidence" in capsys.readouterr().err
    assert folder_tree(out) == before
    fresh = tmp_path / "fresh"
    assert main(["capacity", str(path), "-o", str(fresh), *ARGS, "--confidence", "2"]) == 2
    assert not fresh.exists()  # a folder this run created is removed again


def test_capacity_json_is_written_last_and_every_file_atomically(tmp_path, monkeypatch):
    import servetwin.experiments.run.run_folder as rf

    order = []
    real = rf.RunFolder.record
    monkeypatch.setattr(rf.RunFolder, "record", lambda self, rel: (order.append(rel), real(self, rel))[1])
    path, out = _cfg(tmp_path), tmp_path / "cap"
    assert main(["capacity", str(path), "-o", str(out), *ARGS]) == 0
    assert order[-1] == "capacity.json" and set(order) | {MARKER} == set(folder_tree(out))
    assert {"config.yaml", "probes.csv", "capacity.png", "capacity.md"} <= set(order)


def test_ctrl_c_during_the_search_leaves_a_folder_marked_interrupted(tmp_path, monkeypatch, capsys):
    import servetwin.experiments.capacity.capacity_run as cr

    real = cr.map_with_retries
    calls = []

    def interrupted_after_one_round(*a, **kw):
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(cr, "map_with_retries", interrupted_after_one_round)
    path, out = _cfg(tmp_path), tmp_path / "cap"
    assert main(["capacity", str(path), "-o", str(out), *ARGS]) == 130
    text = capsys.readouterr().out
    assert '"interrupted": true' in text
    answer = json.loads((out / "capacity.json").read_text())
    assert answer["interrupted"] is True and answer["searches"][0]["probes"] >= 1
    assert not [n for n in folder_tree(out) if atomic.TMP_MARK in n]


def test_ctrl_c_while_writing_leaves_no_capacity_json_and_says_so(tmp_path, monkeypatch, capsys):
    import servetwin.experiments.capacity.capacity_report as report

    def interrupted(answer):
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "capacity_markdown", interrupted)
    path, out = _cfg(tmp_path), tmp_path / "cap"
    assert main(["capacity", str(path), "-o", str(out), *ARGS]) == 130
    text = capsys.readouterr().out
    assert "has no capacity.json" in text and "what the searches found" not in text
    names = set(folder_tree(out))
    assert "capacity.json" not in names and "probes.csv" in names
    assert not [n for n in names if atomic.TMP_MARK in n]
