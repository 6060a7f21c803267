"""The output process (`Prewarmed`): a job runs in the prewarmed child, and the caller gets it done even
when the child fails, the job cannot be pickled, or there is no child."""
import os
import threading

from servetwin.experiments.run.background import Prewarmed

PARENT = os.getpid()


def _where(x):
    return x * 2, os.getpid()


def _fails_in_a_child(x):
    if os.getpid() != PARENT:
        raise RuntimeError("the child's disk is full")
    return x + 1


def _warm():
    import json  # noqa: F401  (an import, as the real warm-up does)


def test_the_job_runs_in_the_prewarmed_child():
    w = Prewarmed(_warm, parallel=True)
    assert w.running
    w.submit(_where, (21,))
    value, pid = w.result()
    assert value == 42 and pid != PARENT
    assert not w.running


def test_a_job_that_fails_in_the_child_is_redone_here():
    w = Prewarmed(_warm, parallel=True)
    w.submit(_fails_in_a_child, (1,))
    assert w.result() == 2


def test_an_unpicklable_job_is_done_here_and_without_a_child_too():
    w = Prewarmed(_warm, parallel=True)
    lock = threading.Lock()  # cannot be pickled
    w.submit(lambda lk: (lk.locked(), os.getpid()), (lock,))
    assert w.result() == (False, PARENT)
    inline = Prewarmed(_warm, parallel=False)
    assert not inline.running
    inline.submit(_where, (2,))
    assert inline.result() == (4, PARENT)


def test_close_ends_a_child_that_got_no_job():
    w = Prewarmed(_warm, parallel=True)
    pid = w.pid
    w.close()
    assert not w.running
    try:
        os.waitpid(pid, os.WNOHANG)
        raise AssertionError("the child was not reaped")
    except ChildProcessError:
        pass  # reaped: no zombie left behind


def test_the_output_process_writes_what_the_parent_would(tmp_path, monkeypatch):
    """`servetwin run` through the prewarmed output process and written in the command's own process
    (SERVETWIN_SERIAL_OUTPUT=1): the same files, the same tables, the same summaries."""
    import json

    import pandas as pd
    from exptest_helpers import tiny, write_yaml

    from servetwin.experiments.run import background
    from servetwin.experiments.cli import main

    cfg = write_yaml(tmp_path / "t.yaml", tiny(frontend={"type": "api_server"}))
    outs = {}
    for mode in ("child", "here"):
        if mode == "here":
            monkeypatch.setenv("SERVETWIN_SERIAL_OUTPUT", "1")
        else:
            assert background.parallel_ok()  # this machine has a spare CPU: the child path is taken
        outs[mode] = tmp_path / mode
        assert main(["run", str(cfg), "-o", str(outs[mode]), "--no-progress"]) == 0
    names = {m: sorted(str(p.relative_to(o)) for p in o.rglob("*") if p.is_file()) for m, o in outs.items()}
    assert names["child"] == names["here"] and "sim/trace.json" in names["child"]
    for table in ("steps", "requests", "step_requests"):
        pd.testing.assert_frame_equal(pd.read_parquet(outs["child"] / f"sim/{table}.parquet"),
                                      pd.read_parquet(outs["here"] / f"sim/{table}.parquet"))
    a, b = (json.loads((o / "summary.json").read_text()) for o in outs.values())
    for s in (a, b):
        for backend in s["backends"].values():
            backend.pop("wall_s"), backend.pop("sim_speedup_x")
    assert a == b and a["backends"]["sim"]["itl_s"]["count"] > 0


class _Cycle:
    def __init__(self):
        self.me = self


def test_frozen_heap_spares_what_lived_before_it_collects_what_is_made_in_it_and_undoes_itself():
    import gc
    import weakref

    from servetwin.experiments.run.background import frozen_heap

    gc.collect()
    old = _Cycle()
    old_ref = weakref.ref(old)
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        del old  # garbage now, but frozen: no collection looks at it
        gc.collect()
        assert old_ref() is not None
        new = _Cycle()
        new_ref = weakref.ref(new)
        del new
        gc.collect()
        assert new_ref() is None  # made inside: collected as usual
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert old_ref() is None  # unfrozen: collected again


def test_the_cli_leaves_what_is_alive_at_exit_to_the_os(tmp_path):
    """`servetwin`'s atexit hook: objects in reference cycles at exit are not collected (their finalizers
    do not run), files written before are complete."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from servetwin.experiments.cli import main\n"
        "class C:\n"
        "    def __init__(self): self.me = self\n"
        "    def __del__(self): print('collected', flush=True)\n"
        "c = C(); del c\n"
        "import gc; gc.disable()\n"  # (no collection before exit: the cycle is garbage at exit)
        f"sys.exit(main(sys.argv[1:]) if sys.argv[1:] else 0)\n")
    env = dict(os.environ)
    ran = subprocess.run([sys.executable, "-c", script, "presets"], capture_output=True, text=True, env=env,
                         cwd=tmp_path)
    plain = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert "collected" in plain.stdout  # without the CLI: Python collects the cycle at exit
    assert "collected" not in ran.stdout, ran.stderr
