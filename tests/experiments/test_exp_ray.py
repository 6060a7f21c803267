"""Sweeps and capacity searches on Ray (a local 2-CPU instance on loopback, started and stopped here):
the same tables as the local pool, files travelling with the tasks, a failing point reported."""
import json
import os

import pandas as pd
import pytest
from exptest_helpers import ROOT, tiny, write_yaml

# Ray's switch for machines without clusters: every Ray server of the local instance binds loopback.
# It is read when ray is imported, so it is set first.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")

from servetwin.experiments.cli import main  # noqa: E402

RUN_COLUMNS = {"wall_s", "host", "point_wall_s", "attempts"}  # where and how long: differ by nature
CALIBRATION = ROOT / "experiments" / "calibrations" / "cpu_tiny-llama.yaml"


@pytest.fixture(scope="module")
def local_ray():
    for attempt in (1, 2):  # Ray gives its raylet a fixed 30 s to register: a second try on a loaded machine
        try:
            ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
            break
        except Exception:  # noqa: BLE001
            ray.shutdown()
            if attempt == 2:
                raise
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    yield ray
    ray.shutdown()


def _trace(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens\n"
                    + "".join(f"{0.01 * i:.2f},{12 + 3 * i},{2 + i % 4}\n" for i in range(10)))
    return path


def _same_rows(a: pd.DataFrame, b: pd.DataFrame) -> None:
    cols = [c for c in a.columns if c not in RUN_COLUMNS and not c.startswith("wall_s")]
    assert list(a.columns) == list(b.columns)
    pd.testing.assert_frame_equal(a[cols].reset_index(drop=True), b[cols].reset_index(drop=True))


def test_ray_sweep_matches_the_local_pool_row_by_row(tmp_path, local_ray, capsys):
    # a trace file and a calibration file named by path: both must travel with every task
    cfg = tiny(hardware=str(CALIBRATION), workload={"file": str(_trace(tmp_path))}, seeds=[0, 1],
               sweep={"engine.max_num_seqs": [1, 4]})
    cfg["workload"]["arrival"] = {"type": "poisson", "rate": 40.0}
    path = write_yaml(tmp_path / "s.yaml", cfg)
    local, remote = tmp_path / "local", tmp_path / "ray"
    assert main(["sweep", str(path), "-o", str(local), "--no-progress", "--no-plots"]) == 0
    assert main(["sweep", str(path), "-o", str(remote), "--ray", "--no-progress", "--no-plots"]) == 0
    assert "on Ray (local instance, 2 CPUs on 1 node(s))" in capsys.readouterr().err
    for name in ("sweep_seeds.csv", "sweep.csv"):
        _same_rows(pd.read_csv(local / name), pd.read_csv(remote / name))
    rows = pd.read_csv(remote / "sweep_seeds.csv")
    assert (rows.status == "ok").all() and rows.host.notna().all()
    # the per-point folders are the same files, with the driver's own paths in them
    point = "max_num_seqs=4/seed=1"
    files = lambda d: sorted(os.path.relpath(os.path.join(r, f), d) for r, _, fs in os.walk(d) for f in fs)  # noqa: E731
    assert files(local / point) == files(remote / point)
    assert (local / point / "config.yaml").read_text() == (remote / point / "config.yaml").read_text()
    assert str(CALIBRATION) in (remote / point / "config.yaml").read_text()
    a = json.loads((local / point / "sim" / "summary.json").read_text())
    b = json.loads((remote / point / "sim" / "summary.json").read_text())
    assert {k: v for k, v in a.items() if k not in ("wall_s", "sim_speedup_x")} == \
        {k: v for k, v in b.items() if k not in ("wall_s", "sim_speedup_x")}
    assert "## Where the points ran" in (remote / "sweep.md").read_text()


def test_ray_point_that_raises_is_retried_then_reported_and_the_others_complete(tmp_path, local_ray):
    settings = {"max_num_seqs": 16, "max_num_batched_tokens": 256, "enable_chunked_prefill": True,
                "long_prefill_token_threshold": 0, "block_size": 16, "num_gpu_blocks": 20,
                "enable_prefix_caching": False, "policy": "fcfs", "max_model_len": 1024}
    paths = {}
    for name, token in (("good", 5), ("bad", 10**9)):  # the bad one passes validation, fails when run
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps({"settings": settings, "requests": [
            {"id": f"r{i}", "arrival_step": 0, "prompt_token_ids": [token] * 12, "max_tokens": 3} for i in range(3)]}))
    cfg = tiny(workload={"scenario": str(paths["good"])},
               sweep={"workload.scenario": [str(paths["good"]), str(paths["bad"])]})
    out = tmp_path / "out"
    rc = main(["sweep", str(write_yaml(tmp_path / "s.yaml", cfg)), "-o", str(out), "--ray", "--retries", "1",
               "--no-progress", "--no-plots"])
    assert rc == 1
    table = pd.read_csv(out / "sweep.csv")
    good = table[table.point.str.endswith("good.json")].iloc[0]
    bad = table[table.point.str.endswith("bad.json")].iloc[0]
    assert good.status == "ok" and good.completed == 3 and good.attempts == 1
    assert bad.status == "error" and bad.attempts == 2 and "outside the model's vocabulary" in bad.error
    assert "## Errors" in (out / "sweep.md").read_text()
    assert (out / good.point / "report.md").is_file() and not (out / bad.point / "sim").exists()


def test_ray_capacity_search_matches_the_local_one(tmp_path, local_ray):
    cfg = tiny(workload__requests=20, workload__arrival={"type": "poisson", "rate": 40.0})
    path = write_yaml(tmp_path / "c.yaml", cfg)
    answers = {}
    for how, extra in (("local", []), ("ray", ["--ray"])):
        out = tmp_path / how
        assert main(["capacity", str(path), "--slo", "ttft_p90_s=0.03", "--seeds", "2", "--tol", "0.25",
                     "-o", str(out), "--no-progress", "--no-plots"] + extra) == 0
        answers[how] = json.loads((out / "capacity.json").read_text())["searches"][0]
        probes = pd.read_csv(out / "probes.csv").sort_values(["load", "seed"])
        answers[how + "_probes"] = probes
    for key in ("capacity", "interval", "binding", "per_seed_capacity", "probes"):
        assert answers["local"][key] == answers["ray"][key], key
    _same_rows(answers["local_probes"], answers["ray_probes"])
