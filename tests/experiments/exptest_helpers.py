"""Shared helpers of the experiments tests (tiny configs, YAML files, CLI calls)."""
from __future__ import annotations

import copy
import os
import pathlib

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "experiments" / "configs"
SCENARIOS = ROOT / "experiments" / "scenarios"
CORE_DATA = ROOT / "tests" / "core" / "data"

TINY_SIM = {
    "name": "tiny",
    "seed": 0,
    "model": "tiny-llama",
    "hardware": "cpu",
    "backends": ["sim"],
    "engine": {"max_num_seqs": 4, "max_num_batched_tokens": 64, "enable_chunked_prefill": True,
               "enable_prefix_caching": True, "block_size": 16, "num_gpu_blocks": 64, "max_model_len": 256},
    "workload": {"requests": 6, "arrival": {"type": "offline"},
                 "prompt_tokens": {"type": "uniform", "low": 10, "high": 40},
                 "output_tokens": {"type": "uniform", "low": 3, "high": 8}},
}


def tiny(**changes) -> dict:
    cfg = copy.deepcopy(TINY_SIM)
    for key, value in changes.items():
        node = cfg
        parts = key.split("__")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return cfg


def write_yaml(path: pathlib.Path, data: dict) -> pathlib.Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def folder_tree(root) -> dict[str, bytes]:
    """Every file under `root` (relative path -> bytes): to assert a folder is left exactly as it was."""
    out = {}
    for folder, _, files in os.walk(root):
        for name in files:
            p = os.path.join(folder, name)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = f.read()
    return out


# a staged cluster case for `servetwin validate` (format with its name and router)
STAGED_CLUSTER = """\
name: {name}
model: llama-3.1-8b
hardware: h100-sxm
engine: {{max_num_seqs: 16, max_num_batched_tokens: 2048, max_model_len: 2048}}
workload:
  requests: 9
  shared_prefix: {{groups: 2, per_group: 2, prefix_tokens: 64, suffix_tokens: 8, order: inference_perf}}
  output_tokens: 6
  arrival: {{type: stages, stages: [{{rate: 2, duration_s: 1}}, {{rate: 3, duration_s: 1}}, {{rate: 4, duration_s: 1}}]}}
output: {{step_requests: false, plots: false}}
cluster:
  instances: [{{name: r, count: 2}}]
  router: {router}
"""
