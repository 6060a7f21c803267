"""Shared helpers of the compare/calibrate tests (tiny-llama configs on the CPU)."""
from __future__ import annotations

import copy
import json
import pathlib

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "experiments" / "configs"
CALIBRATIONS = ROOT / "experiments" / "calibrations"
NOTEBOOKS = ROOT / "notebooks"

TINY = {
    "name": "tiny-cmp",
    "seed": 0,
    "model": "tiny-llama",
    "hardware": str(CALIBRATIONS / "cpu_tiny-llama.yaml"),
    "backends": ["sim", "torch"],
    "engine": {"max_num_seqs": 4, "max_num_batched_tokens": 64, "enable_chunked_prefill": True,
               "enable_prefix_caching": True, "block_size": 16, "num_gpu_blocks": 64, "max_model_len": 256,
               "device": "cpu"},
    "workload": {"requests": 8, "arrival": {"type": "offline"},
                 "prompt_tokens": {"type": "uniform", "low": 10, "high": 60},
                 "output_tokens": {"type": "uniform", "low": 3, "high": 10}},
}

REQUIRED_KEYS = ("mode", "identical_composition", "identical_step_share", "steps", "step_abs_pct_error",
                 "by_phase", "makespan_pct_error", "ttft_pct_error", "tpot_pct_error", "e2e_pct_error",
                 "throughput_pct_error", "calibration")


def tiny_config(path: pathlib.Path, **changes) -> pathlib.Path:
    """Write the tiny config with `a__b=value` changes (nested keys joined by `__`)."""
    cfg = copy.deepcopy(TINY)
    for key, value in changes.items():
        node = cfg
        parts = key.split("__")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def read_json(path: pathlib.Path) -> dict:
    return json.loads(pathlib.Path(path).read_text())
