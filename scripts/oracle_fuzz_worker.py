#!/usr/bin/env python3
"""Batch wrapper around a vLLM oracle driver, for `scripts/oracle_fuzz.py`.

Runs under the vLLM venv's Python (never under servetwin's), imports the driver module ONCE (vLLM's
import takes ~15 s) and then records one scenario per request line:

    stdin : {"scenario": {...}, "out": "/path/expected.jsonl"}      (one JSON object per line)
    stdout: FUZZ-WORKER {"ok": true} | FUZZ-WORKER {"ok": false, "error": "..."}

Anything else vLLM prints is not prefixed, so the caller skips it. Each scenario gets a fresh
scheduler from the driver's own `run(scenario, model_dir, out)`; the output file is the driver's
JSONL, byte for byte what `driver.py SCENARIO.json -o OUT` writes.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import traceback

PREFIX = "FUZZ-WORKER "


def load_driver(path: str):
    spec = importlib.util.spec_from_file_location("vllm_oracle_driver_under_fuzz", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--driver: cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("run", "ensure_model_dir"):
        if not hasattr(module, name):
            raise SystemExit(f"--driver: {path} has no {name}()")
    return module


def reply(obj: dict) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--driver", required=True, help="path of vllm_oracle_driver*.py")
    ap.add_argument("--model-dir", default=None,
                    help="config-only tiny model folder (default: a temporary folder)")
    args = ap.parse_args()
    driver = load_driver(args.driver)
    model_dir = args.model_dir or os.path.join(tempfile.mkdtemp(prefix="oracle_fuzz_"), "tiny-llama")
    driver.ensure_model_dir(model_dir)
    try:  # pay vLLM's import before the first "ready" (a stand-in driver in the tests has no vLLM)
        import vllm
        version = getattr(vllm, "__version__", "?")
    except ImportError:
        version = None
    reply({"ok": True, "ready": True, "vllm_version": version})
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        tmp = job["out"] + ".part"
        try:
            with open(tmp, "w") as f:
                driver.run(job["scenario"], model_dir, f)
            os.replace(tmp, job["out"])
            reply({"ok": True})
        except Exception as e:  # a scenario vLLM rejects or chokes on: reported, the worker lives on
            if os.path.exists(tmp):
                os.remove(tmp)
            reply({"ok": False, "error": f"{type(e).__name__}: {e}",
                   "traceback": traceback.format_exc(limit=6)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
