"""Grids and seed counts are counted before anything is expanded (issue 38, item 7): past the documented
limit (`MAX_RUNS`, `--max-runs N` raises it) they are refused at once with exit 2 naming the flag; a large
grid within it prints progress while its points are checked."""
from __future__ import annotations

import pytest
from exptest_helpers import tiny, write_yaml

from servetwin.core.config_error import ConfigError
from servetwin.experiments.cli import main
from servetwin.experiments.config.schema import MAX_RUNS, expand_sweep, seeds_for, validate_config


def one_line_error(capsys, argv: list[str], *needles: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def test_a_billion_point_sweep_is_refused_before_it_is_expanded(tmp_path, capsys):
    values = list(range(1, 1001))
    cfg = write_yaml(tmp_path / "s.yaml", tiny(sweep={"engine.max_num_seqs": values, "seed": values,
                                                      "workload.requests": values}))
    one_line_error(capsys, ["sweep", str(cfg), "-o", str(tmp_path / "o"), "--no-progress"],
                   "sweep: the sweep's points x seeds make 1,000,000,000 runs", f"limit of {MAX_RUNS:,}", "--max-runs")
    assert not (tmp_path / "o").exists()


def test_seeds_multiply_the_count_and_max_runs_overrides(tmp_path):
    exp = validate_config(tiny(sweep={"engine.max_num_seqs": [1, 2, 3]}))
    with pytest.raises(ConfigError, match="make 30 runs, more than the limit of 20"):
        expand_sweep(exp, max_runs=20, seeds=10)
    assert len(expand_sweep(exp, max_runs=30, seeds=10)) == 3


@pytest.mark.parametrize("command", [["run"], ["capacity", "--slo", "ttft_p99_s=1"]])
def test_a_huge_seed_count_is_refused_without_building_it(tmp_path, capsys, command):
    cfg = write_yaml(tmp_path / "c.yaml", tiny())
    one_line_error(capsys, [command[0], str(cfg), "-o", str(tmp_path / "o"), "--seeds", "1000000000", *command[1:]],
                   "--seeds: --seeds 1000000000 make 1,000,000,000 runs", "--max-runs")


def test_a_yaml_seed_count_is_bounded():
    with pytest.raises(ConfigError, match="seeds: 1,000,000,000 seeds, more than the limit"):
        validate_config(tiny(seeds=10 ** 9))
    assert len(seeds_for(validate_config(tiny()), 3)) == 3


def test_a_capacity_grid_past_the_limit_names_the_flag(tmp_path, capsys):
    cfg = write_yaml(tmp_path / "c.yaml", tiny(workload__arrival={"type": "poisson", "rate": 2.0}))
    grid = "engine.max_num_seqs=[" + ",".join(str(v) for v in range(1, 5001)) + "]"
    one_line_error(capsys, ["capacity", str(cfg), "-o", str(tmp_path / "o"), "--slo", "ttft_p99_s=1", "--grid", grid,
                            "--max-runs", "100"], "--grid: the --grid points make 5,000 runs, more than the limit of 100")


def test_a_large_grid_within_the_limit_prints_progress():
    exp = validate_config(tiny(sweep={"workload.requests": list(range(1, 1001))}))
    lines: list[str] = []
    points = expand_sweep(exp, log=lines.append)
    assert len(points) == 1000
    assert "sweep: 500 sweep values checked" in lines and "sweep: 1,000/1,000 grid points checked" in lines


@pytest.mark.parametrize("size", [3, 8, 24])
def test_a_kv_block_size_no_vllm_gpu_backend_supports_is_refused(size):
    """vLLM 0.33's CUDA attention backends take multiples of 16 only (issue 38 item 13)."""
    with pytest.raises(ConfigError, match=f"engine.block_size: must be a multiple of 16 .*got {size}"):
        validate_config(tiny(engine__block_size=size))
    assert validate_config(tiny(engine__block_size=32)).engine.args.block_size == 32
