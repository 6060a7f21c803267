#!/usr/bin/env python3
"""Differential fuzz: random scenarios through vLLM 0.33's own scheduler and through `servetwin replay`.

Each scenario is generated from `(--seed, index)` alone, so any one is reproducible. It runs through a
vLLM oracle driver (`--driver`, under `--vllm-python`; one long-lived worker process imports vLLM once,
`oracle_fuzz_worker.py`) and through servetwin's replay in this process; the step lines are compared as
`tests/core/test_core_replay.py` compares the recorded families (its key lists are imported, so a key
the test learns is fuzzed too). Every divergent scenario is saved with vLLM's output, ours and the
first difference, and (with `--shrink`) a minimised copy that still diverges.

Families (`--families`, comma separated; default `sync,async,events,hybrid`):
  sync    one full-attention group, sync scheduling: chunked prefill on/off, prefix sharing, tight
          pools (preemption), priority policy, n > 1, cache salts, long-prefill thresholds
  async   the same with async scheduling
  events  aborts (both phases), EOS, stop ids, min_tokens, n > 1 with per-child stops; sync or async
  hybrid  several KV cache groups: full + sliding window (windows that are and are not block
          multiples), several sliding groups, chunked local, all sliding; sparse / dense / interval
          retention; tight pools; sometimes async and events too
  big     longer runs (not in the default): 12-32 requests, prompts up to 400 tokens, tight pools,
          KV cache groups 60 % of the time, events 30 %, async 40 %; a third model-sized (prompts
          up to 1200 tokens, windows and chunks up to 1024)
  k       KV connectors (NixlConnector P/D, OffloadingConnector): needs the connectors driver
  s       speculative decoding (ngram / eagle / mtp, acceptance patterns): needs the connectors driver

Usage (see docs/oracle_fuzz.md):
  python scripts/oracle_fuzz.py --vllm-python /tmp/vllm-venv/bin/python \
      --driver PATH/vllm_oracle_driver_hybrid.py -o fuzz_out --count 200 --shrink
Counts (tried / agreed / diverged / rejected per family) go to stdout and OUT/counts.json.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import queue
import random
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "oracle_fuzz_worker.py"
WORKER_PREFIX = "FUZZ-WORKER "
DEFAULT_FAMILIES = ("sync", "async", "events", "hybrid")
# hybrid first: it is where the known divergences live
FAMILY_WEIGHTS = {"sync": 2, "async": 2, "events": 3, "hybrid": 8, "big": 3, "k": 3, "s": 3}
STOP_IDS = (3, 5, 7, 1500, 2048)  # outside the fake sampler's base range 10..1009
EOS = 2


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------------
# scenario generation
# ---------------------------------------------------------------------------------------------------
def _token(rng: random.Random) -> int:
    return rng.randrange(1010, 30000)


def _prompts(rng: random.Random, n: int, max_len: int, block_size: int) -> list[list[int]]:
    """Prompts with shared prefixes (block-aligned or not), exact resends and unrelated ones."""
    bases = [[_token(rng) for _ in range(rng.randint(1, max_len))] for _ in range(rng.randint(1, 3))]
    out: list[list[int]] = []
    for _ in range(n):
        roll = rng.random()
        if out and roll < 0.15:
            p = list(rng.choice(out))  # exact resend
        elif roll < 0.7:
            base = rng.choice(bases)
            if rng.random() < 0.5:
                cut = min(len(base), rng.randint(0, max(1, len(base) // block_size)) * block_size)
            else:
                cut = rng.randint(0, len(base))
            tail = rng.randint(0 if cut else 1, max(1, max_len - cut))
            p = base[:cut] + [_token(rng) for _ in range(tail)]
        else:
            p = [_token(rng) for _ in range(rng.randint(1, max_len))]
        out.append(p[:max_len] or [_token(rng)])
    return out


def _arrivals(rng: random.Random, n: int) -> list[int]:
    style = rng.random()
    if style < 0.3:
        return [0] * n
    if style < 0.7:
        return sorted(rng.randint(0, 12) for _ in range(n))
    return [rng.randint(0, 25) for _ in range(n)]  # file order != arrival order


def _settings(rng: random.Random, async_sched: bool, max_prompt: int, *, small_blocks: bool = True) -> dict:
    block_size = rng.choice((4, 8, 16) if small_blocks else (16,))
    chunked = rng.random() < 0.8
    mnbt = rng.choice((8, 16, 24, 32, 48, 64, 96, 128, 256))
    if not chunked:
        mnbt = max(mnbt, max_prompt + rng.choice((1, 1, 2, 8, 64)))  # max_model_len <= mnbt: vLLM's rule
    max_num_seqs = min(mnbt, rng.choice((1, 2, 3, 4, 6, 8, 16, 256)))
    s: dict[str, Any] = {
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": mnbt,
        "enable_chunked_prefill": chunked,
        "long_prefill_token_threshold": 0,
        "block_size": block_size,
        "num_gpu_blocks": 0,  # set once the requests are known
        "enable_prefix_caching": rng.random() < 0.75,
        "policy": "priority" if rng.random() < 0.2 else "fcfs",
        "max_steps": 300,
    }
    if async_sched:
        s["async_scheduling"] = True
    if chunked:
        if rng.random() < 0.5:
            s["max_model_len"] = rng.choice((max_prompt + 1, max_prompt + 8, max_prompt + 40, 32768))
    else:
        s["max_model_len"] = rng.randint(max_prompt + 1, mnbt) if rng.random() < 0.5 else mnbt
    mml = s.get("max_model_len", mnbt if not chunked else 32768)
    if chunked and rng.random() < 0.25:
        s["long_prefill_token_threshold"] = rng.randint(1, min(mml, mnbt))
    if rng.random() < 0.2:
        s["scheduler_reserve_full_isl"] = rng.random() < 0.5
    if rng.random() < 0.1:
        s["watermark"] = rng.choice((0.01, 0.05, 0.1))
    if rng.random() < 0.1:
        s["max_num_active_seqs"] = rng.randint(1, max_num_seqs)
    if s["long_prefill_token_threshold"] and rng.random() < 0.3:
        s["long_prefill_token_threshold_adaptive"] = True
    return s


def _requests(rng: random.Random, s: dict, n: int, max_prompt: int, allow_n: bool) -> list[dict]:
    mml = s.get("max_model_len", s["max_num_batched_tokens"] if not s["enable_chunked_prefill"] else 32768)
    prompts = _prompts(rng, n, min(max_prompt, mml - 1), s["block_size"])
    arrivals = _arrivals(rng, n)
    salts = ("a", "b") if rng.random() < 0.1 else ()
    reqs = []
    for i, (p, a) in enumerate(zip(prompts, arrivals)):
        r: dict[str, Any] = {"id": f"r{i}", "arrival_step": a, "prompt_token_ids": p,
                             "max_tokens": rng.choice((1, 2, 3, 5, 8, 12, 20, 32, 48))}
        if s["policy"] == "priority":
            r["priority"] = rng.randint(-2, 2)
            if rng.random() < 0.2:  # ties on priority are broken by arrival time
                r["arrival_time"] = round(rng.uniform(0, 20), 3)
        if allow_n and rng.random() < 0.1:
            r["n"] = rng.randint(2, 3)
        if salts and rng.random() < 0.5:
            r["cache_salt"] = rng.choice(salts)
        reqs.append(r)
    return reqs


def _block_need(prompt: int, out: int, s: dict) -> int:
    """The blocks one request can hold at its peak, summed over groups, each window group at most its
    admission cap (vLLM's `max_admission_blocks_per_request`): what servetwin's servable check asks of
    the pool (a request that can never fit is rejected there, a documented deviation; not fuzzed)."""
    bs, mnbt = s["block_size"], s["max_num_batched_tokens"]
    mml = s.get("max_model_len", mnbt if not s["enable_chunked_prefill"] else 32768)
    in_flight = mnbt * (2 if s.get("async_scheduling") else 1)
    full = cdiv(min(prompt + out, mml), bs)
    total = 0
    for g in s.get("kv_cache_groups") or [{"type": "full_attention"}]:
        if g["type"] == "sliding_window":
            total += min(full, cdiv(min(g["sliding_window"] - 1 + in_flight, mml), bs) + 1)
        elif g["type"] == "chunked_local_attention":
            total += min(full, cdiv(min(g["attention_chunk_size"] + in_flight, mml), bs))
        else:
            total += full
    return total


def _size_pool(rng: random.Random, s: dict, reqs: list[dict]) -> None:
    needs = [_block_need(len(r["prompt_token_ids"]), r["max_tokens"], s) for r in reqs]
    biggest = max(needs)
    total = sum(n * r.get("n", 1) for n, r in zip(needs, reqs))
    roll = rng.random()
    if roll < 0.15:
        usable = biggest + rng.randint(0, 2)  # about one request at a time
    elif roll < 0.45:
        usable = rng.randint(biggest, biggest + max(1, (total - biggest) // 4))  # very tight
    elif roll < 0.8:
        usable = rng.randint(biggest, max(biggest, (biggest + total) // 2))  # tight: preemption
    else:
        usable = rng.randint(biggest, total + 8)  # roomy
    s["num_gpu_blocks"] = usable + 1


def _events(rng: random.Random, s: dict, reqs: list[dict], scenario: dict) -> None:
    """EOS / stop ids / min_tokens / stop_at per request; client aborts."""
    if rng.random() < 0.2:
        s["eos_token_id"] = rng.choice((2, 1, 1234))
    eos = s.get("eos_token_id", EOS)
    for r in reqs:
        roll = rng.random()
        if roll < 0.3:
            continue
        if rng.random() < 0.5:
            r["ignore_eos"] = rng.random() < 0.3
        if rng.random() < 0.4:
            r["stop_token_ids"] = rng.sample(STOP_IDS, rng.randint(1, 2))
        if rng.random() < 0.3:
            r["min_tokens"] = rng.randint(0, r["max_tokens"])
        choices = [eos, *r.get("stop_token_ids", []), rng.choice(STOP_IDS)]

        def entries() -> list:
            positions = rng.sample(range(r["max_tokens"] + 2), rng.randint(1, 2))
            return [p if rng.random() < 0.5 else [p, rng.choice(choices)] for p in positions]
        if rng.random() < 0.7:
            n = r.get("n", 1)
            if n > 1 and rng.random() < 0.6:
                r["stop_at"] = {str(k): entries() for k in range(n) if rng.random() < 0.7}
            else:
                r["stop_at"] = entries()
    if rng.random() < 0.6:
        ids = [r["id"] for r in reqs] + [f"{k}_{r['id']}" for r in reqs for k in range(r.get("n", 1))
                                         if r.get("n", 1) > 1]
        last = max(r["arrival_step"] for r in reqs) + 10
        scenario["aborts"] = [
            {"step": rng.randint(0, last), "id": rng.choice(ids),
             **({"phase": rng.choice(("between_steps", "during_step"))} if rng.random() < 0.8 else {})}
            for _ in range(rng.randint(1, 3))]


def _kv_groups(rng: random.Random, block_size: int, max_blocks: int = 6) -> list[dict]:
    """A group layout; windows up to `max_blocks` blocks, chunks up to one block fewer."""
    def window() -> int:
        if rng.random() < 0.5:
            return block_size * rng.randint(1, max_blocks)  # a block multiple
        return rng.randint(2, max_blocks * block_size)

    def chunk() -> int:
        if rng.random() < 0.7:
            return block_size * rng.randint(1, max_blocks - 1)
        return rng.randint(1, (max_blocks - 1) * block_size)
    full = {"type": "full_attention"}
    kind = rng.choice(("full+sw", "full+sw", "sw+full", "full+3sw", "full+3sw", "5sw+full", "2sw", "2sw",
                       "3sw", "sw", "full+chunked", "3chunked+full", "chunked", "full+2sw_mixed"))
    if kind == "5sw+full":  # Gemma-3: five sliding groups, then the full one
        w = window()
        return [{"type": "sliding_window", "sliding_window": w} for _ in range(5)] + [full]
    if kind in ("full+sw", "sw+full"):
        sw = {"type": "sliding_window", "sliding_window": window()}
        return [full, sw] if kind == "full+sw" else [sw, full]
    if kind == "full+3sw":
        w = window()
        sws = [{"type": "sliding_window", "sliding_window": w} for _ in range(3)]
        return sws + [full] if rng.random() < 0.5 else [full] + sws
    if kind in ("2sw", "3sw"):
        same = rng.random() < 0.5
        w = window()
        return [{"type": "sliding_window", "sliding_window": w if same else window()}
                for _ in range(2 if kind == "2sw" else 3)]
    if kind == "sw":
        return [{"type": "sliding_window", "sliding_window": window()}]
    if kind == "full+2sw_mixed":
        return [full, {"type": "sliding_window", "sliding_window": window()},
                {"type": "sliding_window", "sliding_window": window()}]
    if kind == "full+chunked":
        return [full, {"type": "chunked_local_attention", "attention_chunk_size": chunk()}]
    if kind == "chunked":
        return [{"type": "chunked_local_attention", "attention_chunk_size": chunk()}]
    c = chunk()
    return [{"type": "chunked_local_attention", "attention_chunk_size": c} for _ in range(3)] + [full]


def gen_plain(rng: random.Random, async_sched: bool) -> dict:
    max_prompt = rng.choice((16, 40, 80, 160))
    s = _settings(rng, async_sched, max_prompt)
    reqs = _requests(rng, s, rng.randint(1, 8), max_prompt, allow_n=True)
    _size_pool(rng, s, reqs)
    return {"settings": s, "requests": reqs}


def gen_sync(rng: random.Random) -> dict:
    return gen_plain(rng, False)


def gen_async(rng: random.Random) -> dict:
    return gen_plain(rng, True)


def gen_events(rng: random.Random) -> dict:
    sc = gen_plain(rng, rng.random() < 0.5)
    _events(rng, sc["settings"], sc["requests"], sc)
    return sc


def _hybrid_settings(rng: random.Random, s: dict, max_blocks: int = 6) -> None:
    """KV cache groups and a retention setting (absent = sparse, 0, null = dense, or an interval)."""
    s["enable_prefix_caching"] = rng.random() < 0.85
    groups = _kv_groups(rng, s["block_size"], max_blocks)
    s["kv_cache_groups"] = groups
    roll = rng.random()
    has_sw = any(g["type"] == "sliding_window" for g in groups)
    if roll < 0.2:
        s["prefix_cache_retention_interval"] = None  # dense
    elif roll < 0.3:
        s["prefix_cache_retention_interval"] = 0
    elif roll < 0.45 and has_sw:
        s["prefix_cache_retention_interval"] = s["block_size"] * rng.randint(1, 4)


def gen_hybrid(rng: random.Random) -> dict:
    max_prompt = rng.choice((24, 48, 80, 128, 200))
    s = _settings(rng, rng.random() < 0.3, max_prompt)
    _hybrid_settings(rng, s)
    reqs = _requests(rng, s, rng.randint(1, 12 if rng.random() < 0.3 else 8), max_prompt,
                     allow_n=rng.random() < 0.3)
    _size_pool(rng, s, reqs)
    sc = {"settings": s, "requests": reqs}
    if rng.random() < 0.25:
        _events(rng, s, reqs, sc)
    return sc


def gen_big(rng: random.Random) -> dict:
    """Longer runs: 12-32 requests, prompts up to 400 tokens, tight pools; KV cache groups 60 % of
    the time, events 30 %, async 40 %. A third are model-sized: blocks of 16, prompts up to 1200
    tokens, windows / chunks up to 1024 tokens, budgets up to 2048."""
    large = rng.random() < 0.33
    max_prompt = rng.choice((600, 900, 1200) if large else (128, 256, 400))
    s = _settings(rng, rng.random() < 0.4, max_prompt, small_blocks=not large and rng.random() < 0.5)
    if large and s["enable_chunked_prefill"]:
        s["max_num_batched_tokens"] = max(s["max_num_batched_tokens"], rng.choice((256, 512, 1024, 2048)))
    if rng.random() < 0.6:
        _hybrid_settings(rng, s, 64 if large else 6)
    reqs = _requests(rng, s, rng.randint(12, 32), max_prompt, allow_n=rng.random() < 0.3)
    s["max_steps"] = 800
    _size_pool(rng, s, reqs)
    sc = {"settings": s, "requests": reqs}
    if rng.random() < 0.3:
        _events(rng, s, reqs, sc)
    return sc


def gen_connector(rng: random.Random) -> dict:
    """KV connectors (CONNECTORS contract): NixlConnector roles or OffloadingConnector."""
    max_prompt = rng.choice((24, 48, 96))
    s = _settings(rng, rng.random() < 0.3, max_prompt)
    reqs = _requests(rng, s, rng.randint(1, 6), max_prompt, allow_n=False)
    if rng.random() < 0.6:
        role = rng.choice(("kv_consumer", "kv_producer", "kv_both"))
        conn: dict[str, Any] = {"name": "NixlConnector", "role": role}
        if rng.random() < 0.4:
            conn["kv_load_failure_policy"] = rng.choice(("fail", "recompute"))
        if rng.random() < 0.5:
            conn["recv_delay_steps"] = rng.randint(0, 4)
        if rng.random() < 0.5:
            conn["send_delay_steps"] = rng.choice((None, 0, 1, 3))
        if rng.random() < 0.5:
            conn["lease_steps"] = rng.choice((None, 2, 6))
        for r in reqs:
            if rng.random() < 0.4:
                continue
            flag = {"kv_consumer": "do_remote_prefill", "kv_producer": "do_remote_decode"}.get(
                role, rng.choice(("do_remote_prefill", "do_remote_decode")))
            r["kv_transfer_params"] = {flag: True}
            if flag == "do_remote_prefill" and rng.random() < 0.4:
                r["kv_recv"] = {"delay_steps": rng.randint(0, 3)}
                if rng.random() < 0.3:
                    r["kv_recv"]["fail"] = "all" if rng.random() < 0.5 else [0]
            if flag == "do_remote_decode" and rng.random() < 0.3:
                r["kv_send"] = {"delay_steps": rng.choice((None, 0, 2))}
    else:
        conn = {"name": "OffloadingConnector", "cpu_bytes_to_use": 4096 * rng.randint(1, 24)}
        if rng.random() < 0.3:
            conn["eviction_policy"] = "arc"
        if rng.random() < 0.3:
            conn["store_threshold"] = rng.randint(0, 3)
        if rng.random() < 0.4:
            conn["load_delay_steps"] = rng.randint(0, 3)
        if rng.random() < 0.3:
            conn["store_delay_steps"] = rng.randint(1, 3)
        s["enable_prefix_caching"] = True
    s["kv_connector"] = conn
    _size_pool(rng, s, reqs)
    return {"settings": s, "requests": reqs}


def gen_spec(rng: random.Random) -> dict:
    """Speculative decoding (CONNECTORS contract): drafts, acceptance, budgets."""
    max_prompt = rng.choice((24, 48, 96))
    async_sched = rng.random() < 0.3
    s = _settings(rng, async_sched, max_prompt)
    k = rng.randint(1, 5)
    method = rng.choice(("eagle", "mtp") if async_sched else ("ngram", "eagle", "mtp"))
    s["max_num_batched_tokens"] = max(s["max_num_batched_tokens"], k + 1)
    acceptance: Any = rng.choice(("all", "none", {"seed": rng.randint(0, 999)},
                                  {"pattern": [rng.randint(0, k) for _ in range(rng.randint(1, 4))]}))
    s["speculative"] = {"num_speculative_tokens": k, "method": method, "acceptance": acceptance}
    reqs = _requests(rng, s, rng.randint(1, 6), max_prompt, allow_n=False)
    for r in reqs:
        if not async_sched and rng.random() < 0.3:
            r["draft_lengths"] = [rng.randint(0, k) for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.2:
            r["accept_pattern"] = [rng.randint(0, k) for _ in range(rng.randint(1, 3))]
    _size_pool(rng, s, reqs)
    sc = {"settings": s, "requests": reqs}
    if rng.random() < 0.3:
        _events(rng, s, reqs, sc)
    return sc


GENERATORS: dict[str, Callable[[random.Random], dict]] = {
    "sync": gen_sync, "async": gen_async, "events": gen_events, "hybrid": gen_hybrid,
    "big": gen_big, "k": gen_connector, "s": gen_spec,
}


def generate(seed: int, index: int, families: list[str]) -> tuple[str, dict]:
    """The scenario `index` of run `seed`: the same pair always gives the same scenario."""
    rng = random.Random(f"oracle-fuzz:{seed}:{index}")
    family = rng.choices(families, weights=[FAMILY_WEIGHTS[f] for f in families])[0]
    return family, GENERATORS[family](rng)


# ---------------------------------------------------------------------------------------------------
# the two sides
# ---------------------------------------------------------------------------------------------------
class VllmOracle:
    """One worker process under the vLLM venv; restarted after a crash or a timeout."""

    def __init__(self, python: str, driver: str, log_path: Path, timeout_s: float) -> None:
        self.cmd = [python, str(WORKER), "--driver", driver]
        self.log_path = log_path
        self.timeout_s = timeout_s
        self.proc: Optional[subprocess.Popen] = None
        self.lines: "queue.Queue[Optional[str]]" = queue.Queue()
        self.version = "?"

    def _start(self) -> None:
        env = dict(os.environ, VLLM_TARGET_DEVICE=os.environ.get("VLLM_TARGET_DEVICE", "cpu"),
                   PYTHONHASHSEED="0")
        env.pop("PYTHONPATH", None)  # the worker must not see servetwin (nor it vLLM)
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                     text=True, env=env, bufsize=1)
        self.lines = queue.Queue()
        threading.Thread(target=self._pump, args=(self.proc, self.lines), daemon=True).start()
        ready = self._reply(300.0)
        if not ready.get("ok"):
            raise RuntimeError(f"the vLLM worker did not start: {ready} (log: {self.log_path})")
        self.version = ready.get("vllm_version", "?")

    @staticmethod
    def _pump(proc: subprocess.Popen, lines: "queue.Queue[Optional[str]]") -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(WORKER_PREFIX):
                lines.put(line[len(WORKER_PREFIX):])
        lines.put(None)

    def _reply(self, timeout: float) -> dict:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            self.stop()
            return {"ok": False, "error": f"timeout after {timeout:.0f} s", "timeout": True}
        if line is None:
            self.stop()
            return {"ok": False, "error": "the vLLM worker exited", "crash": True}
        return json.loads(line)

    def run(self, scenario: dict, out: Path) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"scenario": scenario, "out": str(out)}) + "\n")
        self.proc.stdin.flush()
        return self._reply(self.timeout_s)

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
        self.proc = None


def _load_replay_test():
    """tests/core/test_core_replay.py: the key lists the recorded families are compared on."""
    spec = importlib.util.spec_from_file_location("_servetwin_replay_test",
                                                  REPO / "tests" / "core" / "test_core_replay.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def run_ours(scenario: dict) -> tuple[str, Any]:
    """("ok", lines) | ("rejected", message) | ("crash", traceback)."""
    from servetwin.core.config_error import ConfigError
    from servetwin.core.testbed.replay import replay
    from servetwin.core.testbed.scenario import parse_scenario
    try:
        lines = list(replay(parse_scenario(json.loads(json.dumps(scenario)))))
    except ConfigError as e:
        return "rejected", str(e)
    except Exception:  # a crash of ours is a divergence too
        return "crash", traceback.format_exc(limit=8)
    return "ok", json.loads(json.dumps(lines))  # the JSON view the oracle's file has


def first_difference(expected: list[dict], ours: list[dict], keys) -> Optional[str]:
    """The replay test's comparison (test_replay_matches_vllm_oracle), returning the first difference."""
    if [r["type"] for r in ours] != [r["type"] for r in expected]:
        n = next((i for i, (a, b) in enumerate(zip(expected, ours)) if a["type"] != b["type"]),
                 min(len(expected), len(ours)))
        return (f"line {n}: line types differ (vLLM {len(expected)} lines, ours {len(ours)}; "
                f"vLLM step {expected[n].get('step') if n < len(expected) else None}, "
                f"ours {ours[n].get('step') if n < len(ours) else None})")
    for exp, got in zip(expected, ours):
        if exp["type"] == "config":
            diff = _config_difference(exp, got, keys)
        elif exp["type"] == "summary":
            diff = next((f"summary.{k}: vLLM {exp[k]!r} ours {got.get(k)!r}" for k in keys.SUMMARY_KEYS
                         if (k in exp and (got.get(k) != exp[k] or (isinstance(exp[k], dict)
                                                                    and list(got[k]) != list(exp[k]))))
                         or (k not in exp and k in got)), None)
        else:
            diff = _step_difference(exp, got, keys)
        if diff:
            return diff
    return None


def _config_difference(exp: dict, got: dict, keys) -> Optional[str]:
    for k in ("max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks", "block_size"):
        if got["settings"].get(k) != exp["settings"].get(k):
            return f"config.settings.{k}"
    if got["settings"].get("max_model_len") != exp["effective"]["max_model_len"]:
        return f"config max_model_len: vLLM {exp['effective']['max_model_len']} ours {got['settings'].get('max_model_len')}"
    for k in keys.HYBRID_EFFECTIVE_KEYS:
        if k in exp["effective"] and got.get("effective", {}).get(k) != exp["effective"][k]:
            return f"config.effective.{k}: vLLM {exp['effective'][k]!r} ours {got.get('effective', {}).get(k)!r}"
        if k not in exp["effective"] and k in got.get("effective", {}):
            return f"config.effective.{k}: ours only"
    return None


def _step_difference(exp: dict, got: dict, keys) -> Optional[str]:
    where = f"step {exp.get('step')}"
    if got.get("step") != exp.get("step"):
        return f"{where}: ours is step {got.get('step')}"
    if exp.get("drain_only"):
        if got.get("drain_only") is not True or got.get("processed_output_of_step") != exp.get(
                "processed_output_of_step"):
            return f"{where}: drain_only"
        return None
    idle = exp.get("idle") is True
    for k in keys.STEP_KEYS:
        if k not in exp:
            if not (k not in got or k == "finished" or got[k] in (None, False) or (idle and got[k] in ({}, []))):
                return f"{where}.{k}: ours only {got[k]!r}"
            continue
        if k == "finished":
            mine = [[rid, got["finish_reasons"][rid]] for rid in got.get("finished", [])]
            if keys.errors_unordered(mine) != keys.errors_unordered(exp[k]):  # (vLLM: set order, hash-seeded)
                return f"{where}.finished: vLLM {exp[k]!r} ours {mine!r}"
        elif k == "num_scheduled_tokens":
            if list(got.get(k, {}).items()) != list(exp[k].items()):
                return f"{where}.{k}: vLLM {exp[k]!r} ours {got.get(k)!r}"
        elif got.get(k) != exp[k]:
            return f"{where}.{k}: vLLM {exp[k]!r} ours {got.get(k)!r}"
    return None


# ---------------------------------------------------------------------------------------------------
# the fuzz loop, the shrinker and the bookkeeping
# ---------------------------------------------------------------------------------------------------
class Fuzz:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.output)
        self.work = self.out / "work"
        for d in (self.out, self.work, self.out / "diverged", self.out / "vllm_errors", self.out / "rejected"):
            d.mkdir(parents=True, exist_ok=True)
        self.oracle = VllmOracle(args.vllm_python, args.driver, self.out / "vllm_worker.log", args.timeout)
        self.keys = _load_replay_test()
        self.counts: dict[str, dict[str, int]] = {}
        self.diverged: list[dict] = []
        self.started = time.time()

    def check(self, scenario: dict) -> tuple[str, Any, Any]:
        """(outcome, vLLM lines or error, ours or message); outcome: agree | diverge | vllm_error |
        rejected (ours rejects what vLLM ran) | crash (ours raised)."""
        path = self.work / "expected.jsonl"
        res = self.oracle.run(scenario, path)
        if not res.get("ok"):
            return "vllm_error", res, None
        expected = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        status, ours = run_ours(scenario)
        if status != "ok":
            return status, expected, ours
        diff = first_difference(expected, ours, self.keys)
        return ("diverge" if diff else "agree"), expected, (ours, diff)

    def count(self, family: str, outcome: str) -> None:
        c = self.counts.setdefault(family, {"tried": 0})
        c["tried"] += 1
        c[outcome] = c.get(outcome, 0) + 1

    def save(self, folder: str, name: str, scenario: dict, expected: Any, extra: dict) -> Path:
        base = self.out / folder / name
        Path(f"{base}.json").write_text(json.dumps(scenario, indent=1) + "\n")
        if isinstance(expected, list):
            Path(f"{base}.expected.jsonl").write_text("".join(json.dumps(x) + "\n" for x in expected))
        Path(f"{base}.info.json").write_text(json.dumps(extra, indent=1, default=str) + "\n")
        return base

    def write_counts(self) -> None:
        total = {"tried": 0}
        for c in self.counts.values():
            for k, v in c.items():
                total[k] = total.get(k, 0) + v
        data = {"seed": self.args.seed, "driver": self.args.driver, "vllm_version": self.oracle.version,
                "elapsed_s": round(time.time() - self.started), "total": total, "per_family": self.counts,
                "diverged": self.diverged}
        tmp = self.out / "counts.json.part"
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, self.out / "counts.json")

    def run(self) -> int:
        args = self.args
        families = args.families.split(",")
        deadline = time.time() + args.minutes * 60 if args.minutes else None
        i = args.start
        while (args.count is None or i < args.start + args.count) and (deadline is None or time.time() < deadline):
            family, scenario = generate(args.seed, i, families)
            name = f"{family}_{args.seed}_{i}"
            outcome, expected, ours = self.check(scenario)
            self.count(family, outcome)
            if outcome == "vllm_error":
                if self.counts[family].get("vllm_error", 0) <= 20:
                    self.save("vllm_errors", name, scenario, None, expected)
            elif outcome == "rejected":
                if self.counts[family].get("rejected", 0) <= 20:
                    self.save("rejected", name, scenario, expected, {"ours": ours})
            elif outcome in ("diverge", "crash"):
                diff = ours[1] if outcome == "diverge" else ours
                self.save("diverged", name, scenario, expected, {"family": family, "difference": diff})
                record = {"name": name, "family": family, "outcome": outcome,
                          "difference": diff if outcome == "diverge" else diff.strip().splitlines()[-1]}
                if args.shrink:
                    small, small_exp, small_diff = self.shrink(scenario, outcome)
                    self.save("diverged", name + ".min", small, small_exp, {"difference": small_diff})
                    record["min_requests"] = len(small["requests"])
                    record["min_difference"] = small_diff
                self.diverged.append(record)
                print(f"DIVERGED {name}: {record['difference']}", flush=True)
            if (i - args.start + 1) % args.report_every == 0:
                self.print_counts()
            self.write_counts()
            i += 1
        self.oracle.stop()
        self.write_counts()
        self.print_counts()
        return 0

    def recheck(self, where: Path) -> int:
        """Run saved scenarios again (after a fix): the outcome of each, and 1 if any still differs."""
        paths = [where] if where.is_file() else sorted(
            p for p in where.glob("*.json") if not p.name.endswith(".info.json"))
        still = 0
        for p in paths:
            outcome, _exp, ours = self.check(json.loads(p.read_text()))
            detail = ours[1] if outcome == "diverge" else ("" if outcome == "agree" else str(ours)[:300])
            print(f"{outcome:10} {p.name} {detail or ''}", flush=True)
            still += outcome not in ("agree", "vllm_error")
        self.oracle.stop()
        print(f"{len(paths)} rechecked, {still} still differ")
        return 1 if still else 0

    def print_counts(self) -> None:
        parts = [f"{f}: " + " ".join(f"{k}={v}" for k, v in c.items()) for f, c in sorted(self.counts.items())]
        print(f"[{time.strftime('%H:%M:%S')}] " + " | ".join(parts), flush=True)

    # -- shrinker -----------------------------------------------------------------------------------
    def shrink(self, scenario: dict, outcome: str) -> tuple[dict, Any, Any]:
        """Greedy: drop requests, aborts and stop plans, cut max_steps and max_tokens, as long as the
        scenario still diverges (or crashes) in the same way."""
        best = json.loads(json.dumps(scenario))
        best_exp, best_diff = None, None
        budget = [self.args.shrink_tries]

        def still(c: dict) -> bool:
            if budget[0] <= 0:
                return False
            budget[0] -= 1
            got, exp, ours = self.check(c)
            if got != outcome:
                return False
            nonlocal best_exp, best_diff
            best_exp, best_diff = exp, (ours[1] if got == "diverge" else ours)
            return True

        for candidate in self._shrink_steps(best):
            c = candidate()
            if c is not None and still(c):
                best.clear()
                best.update(c)
        return best, best_exp, best_diff

    def _shrink_steps(self, sc: dict):
        """Candidate makers, each reading the current best `sc` when called."""
        def drop_request(j: int):
            def make():
                if j >= len(sc["requests"]) or len(sc["requests"]) <= 1:
                    return None
                c = json.loads(json.dumps(sc))
                gone = c["requests"].pop(j)
                ids = {gone["id"], *(f"{k}_{gone['id']}" for k in range(gone.get("n", 1)))}
                if "aborts" in c:
                    c["aborts"] = [a for a in c["aborts"] if a["id"] not in ids]
                    if not c["aborts"]:
                        del c["aborts"]
                return c
            return make

        def edit(fn):
            def make():
                c = json.loads(json.dumps(sc))
                return c if fn(c) else None
            return make

        for _ in range(2):
            for j in range(len(sc["requests"]) - 1, -1, -1):
                yield drop_request(j)
        yield edit(lambda c: c.pop("aborts", None) is not None)
        for j in range(len(sc["requests"])):
            yield edit(lambda c, j=j: j < len(c["requests"]) and c["requests"][j].pop("stop_at", None) is not None)
            for cut in (1, 2, 4):
                yield edit(lambda c, j=j, cut=cut: j < len(c["requests"]) and _shrink_tokens(c["requests"][j], cut))
        for steps in (8, 16, 32, 64):
            yield edit(lambda c, steps=steps: c["settings"].get("max_steps", 10000) > steps
                       and c["settings"].update(max_steps=steps) is None)
        yield edit(lambda c: c["settings"].get("num_gpu_blocks", 0) > 2
                   and c["settings"].update(num_gpu_blocks=c["settings"]["num_gpu_blocks"] - 1) is None)


def _shrink_tokens(r: dict, keep_fraction_denominator: int) -> bool:
    """max_tokens -> max(1, max_tokens // (2 * d)); False when nothing changes."""
    new = max(1, r["max_tokens"] // (2 * keep_fraction_denominator))
    if new == r["max_tokens"]:
        return False
    r["max_tokens"] = new
    r["min_tokens"] = min(r.get("min_tokens", 0), new) if "min_tokens" in r else r.get("min_tokens", 0)
    if "min_tokens" in r and r["min_tokens"] == 0:
        del r["min_tokens"]
    return True


def main(argv: Optional[list[str]] = None) -> int:
    if os.environ.get("PYTHONHASHSEED") != "0" and argv is None:
        # vLLM iterates sets of request ids in places (finished_req_ids, failed loads), and so does the
        # scheduler here: both sides need the oracle worker's string-hash seed to order them alike
        os.execve(sys.executable, [sys.executable, *sys.argv], dict(os.environ, PYTHONHASHSEED="0"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--vllm-python", required=True, help="Python of the venv where vLLM 0.33.0 is installed")
    ap.add_argument("--driver", required=True,
                    help="the oracle driver (vllm_oracle_driver_hybrid.py; _connectors.py for k,s)")
    ap.add_argument("-o", "--output", required=True, help="folder for counts, divergences and logs")
    ap.add_argument("--families", default=",".join(DEFAULT_FAMILIES),
                    help=f"comma-separated, of {', '.join(GENERATORS)} (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="run seed; scenario i of a seed is always the same")
    ap.add_argument("--start", type=int, default=0, help="first scenario index")
    ap.add_argument("--count", type=int, default=None, help="scenarios to try (default: until --minutes)")
    ap.add_argument("--minutes", type=float, default=None, help="stop after this many minutes")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds for vLLM on one scenario")
    ap.add_argument("--shrink", action="store_true", help="minimise each divergent scenario")
    ap.add_argument("--shrink-tries", type=int, default=120, help="vLLM runs one minimisation may spend")
    ap.add_argument("--report-every", type=int, default=50, help="print the counts every N scenarios")
    ap.add_argument("--recheck", default=None,
                    help="re-check saved scenarios (a .json file, or every *.json of a folder, e.g. OUT/diverged "
                         "or tests/core/data) and print each outcome; exit 1 if any still differs")
    args = ap.parse_args(argv)
    for f in args.families.split(","):
        if f not in GENERATORS:
            ap.error(f"--families: unknown family {f!r} (one of {', '.join(GENERATORS)})")
    if args.count is None and args.minutes is None and args.recheck is None:
        ap.error("give --count or --minutes")
    for flag, path in (("--vllm-python", args.vllm_python), ("--driver", args.driver)):
        if not os.path.exists(path):
            ap.error(f"{flag}: {path} does not exist")
    fuzz = Fuzz(args)
    if args.recheck:
        return fuzz.recheck(Path(args.recheck))
    return fuzz.run()


if __name__ == "__main__":
    sys.exit(main())
