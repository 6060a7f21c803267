"""How many file-to-file hops a request crosses from `servetwin run` to the first engine step.

    python scripts/hop_count.py            # the servetwin on sys.path (PYTHONPATH=DIR for another checkout)

Runs `servetwin run` on a tiny sim-only experiment and records, with `sys.setprofile`, every Python call
into a file of the servetwin package until the first `execute_model` of an executor. Reported:
- hops: transitions between different files in that sequence of calls (a call into file B right after a
  call into file A counts once; calls within one file count nothing);
- files: the distinct package files touched;
- stack: the package files on the call stack at the first execute_model (the chain that is still open).
"""
from __future__ import annotations

import os
import sys
import tempfile

import yaml

CONFIG = {"name": "hops", "model": "tiny-llama", "hardware": "cpu", "backends": ["sim"],
          "engine": {"max_num_seqs": 4, "max_num_batched_tokens": 64, "num_gpu_blocks": 64, "max_model_len": 256},
          "workload": {"requests": 2, "arrival": {"type": "offline"}, "prompt_tokens": 16, "output_tokens": 2},
          "output": {"plots": False}}


def main() -> int:
    import servetwin
    from servetwin.experiments.cli import main as cli_main

    root = os.path.dirname(os.path.abspath(servetwin.__file__))
    calls: list[str] = []
    stack_at_first: list[str] = []
    done = False

    def profile(frame, event, arg):
        nonlocal done, stack_at_first
        if done or event != "call":
            return
        path = frame.f_code.co_filename
        if not path.startswith(root) or any(part in path for part in ("/tests/", "/scripts/", "site-packages")):
            return  # only the package's own files (a venv inside the checkout is not the package)
        rel = os.path.relpath(path, root)
        calls.append(rel)
        if frame.f_code.co_name == "execute_model":
            done = True
            f, chain = frame, []
            while f is not None:
                p = f.f_code.co_filename
                if p.startswith(root) and "site-packages" not in p and "/scripts/" not in p:
                    r = os.path.relpath(p, root)
                    if not chain or chain[-1] != r:
                        chain.append(r)
                f = f.f_back
            stack_at_first = chain[::-1]

    with tempfile.TemporaryDirectory() as tmp:
        cfg = os.path.join(tmp, "hops.yaml")
        with open(cfg, "w") as f:
            yaml.safe_dump(CONFIG, f)
        sys.setprofile(profile)
        try:
            rc = cli_main(["run", cfg, "-o", os.path.join(tmp, "out"), "--no-progress"])
        finally:
            sys.setprofile(None)
    hops = sum(1 for a, b in zip(calls, calls[1:]) if a != b)
    print(f"servetwin at {root}: exit {rc}")
    print(f"calls into package files before the first execute_model: {len(calls)}")
    print(f"file-to-file hops: {hops}; distinct files: {len(set(calls))}; "
          f"files on the stack at the first execute_model: {len(stack_at_first)}")
    print("stack: " + " -> ".join(stack_at_first))
    return 0


if __name__ == "__main__":
    sys.exit(main())
