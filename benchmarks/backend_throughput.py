"""Offline throughput of the torch backend against HF transformers (issue 4 section 4).

    python benchmarks/backend_throughput.py                      # 64 requests, the full run
    python benchmarks/backend_throughput.py --requests 8 --max-output 48   # a quick one

Workload (seeded): `--requests` prompts of uniform random length in [--min-prompt, --max-prompt]
(default 32-512 tokens, token ids drawn from the model's vocabulary, special ids below 100 avoided)
and output lengths uniform in [--min-output, --max-output] (default 32-256). Every system runs
greedy, ignores EOS and must produce exactly each request's own number of output tokens. All in
one process, on the CPU in float32, one after the other, each after a short untimed warm-up; only
generation is timed (model loading is not).

Systems:
1. servetwin: `LLM(model, backend="torch", multiprocess=False, max_num_seqs=B)`, one `generate`
   call with one `SamplingParams(temperature=0, ignore_eos=True, max_tokens=o_i)` per request, in the
   workload's order (first come, first served: no use of the known output lengths). On the CPU in
   float32 it uses the native kernels of `gpu/cpu_kernels.py` (paged decode attention, small-batch
   linear, greedy argmax) and `gpu/cpu_layer_kernels.py` (RMSNorm with the residual add, q/k norm +
   RoPE, a whole MoE layer), built with the system C compiler on first use (untimed: in `LLM()` or the
   warm-up); `--no-cpu-kernels` runs the pure-torch path instead (SERVETWIN_CPU_KERNELS=0).
2. HF `generate` with padded static batching: requests are grouped - sorted by output length
   (longest first) and cut into batches of B = servetwin's max_num_seqs - so each batch's
   `max_new_tokens` (its longest request) wastes little (`--hf-grouping input` keeps request order
   instead, a naive static batcher); prompts are left-padded
   (attention_mask), EOS is disabled (`generation_config.eos_token_id = None`, so no masking and no
   stopping) and every output is truncated to its request's length. Output tokens counted are the
   requested ones only; the wasted ones cost time but are not credited. attn_implementation="sdpa"
   (HF's default and its fastest on the CPU).
3. HF continuous batching (transformers >= 5: `model.continuous_batching_context_manager` /
   `ContinuousBatchingManager.add_request(input_ids, max_new_tokens=o_i, eos_token_id=-1)`; the
   per-request max_new_tokens is why `generate_batch` - one max_new_tokens for all - is not used),
   max_requests_per_batch = B, a KV cache of servetwin's pool's capacity (`num_blocks`; unset, HF
   would size it from the host's RAM). Skipped with a message if the installed transformers lacks it or it
   fails.

Timing: wall time of the generation only; the process CPU time (all threads) over the same span is
printed too, and
"x by cpu s" compares CPU seconds - on a shared machine other jobs inflate wall time (OpenMP threads
spin at barriers when the cores are oversubscribed), so run it when `uptime` shows a quiet machine
and compare the load averages printed beside each system.

Equality: for greedy decoding the token ids of every request are compared with servetwin's; the
fraction of requests that match exactly and the mean position of the first difference are printed
(fp32 reduction-order differences can flip a near-tied argmax late in a sequence; reported, not
hidden).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def make_workload(args, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(args.seed)
    lo_tok = min(100, vocab_size // 4)
    plens = rng.integers(args.min_prompt, args.max_prompt + 1, size=args.requests)
    olens = rng.integers(args.min_output, args.max_output + 1, size=args.requests)
    prompts = [rng.integers(lo_tok, vocab_size, size=int(n)).tolist() for n in plens]
    return prompts, [int(o) for o in olens]


def model_len(prompts, olens) -> int:
    """servetwin's max_model_len: the longest request, in whole 16-token blocks, at least 1024."""
    longest = max(len(p) + o for p, o in zip(prompts, olens))
    return max(1024, -(-longest // 16) * 16)


def kv_pool_blocks(args, prompts, olens) -> int:
    """servetwin's KV pool in 16-token blocks: `--num-gpu-blocks`, or room for a full batch of the longest."""
    return args.num_gpu_blocks or (args.batch_size * (model_len(prompts, olens) // 16) + 64)


# -- the three systems ---------------------------------------------------------------------------------
def run_servetwin(args, prompts, olens) -> dict[str, Any]:
    from servetwin.core import LLM, SamplingParams  # noqa: PLC0415

    max_model_len = model_len(prompts, olens)
    blocks = kv_pool_blocks(args, prompts, olens)
    t0 = time.perf_counter()
    llm = LLM(model=args.model, backend="torch", multiprocess=False, max_num_seqs=args.batch_size,
              num_gpu_blocks=blocks, max_model_len=max_model_len, dtype="float32", device="cpu")
    load_s = time.perf_counter() - t0
    warm = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)]
    llm.generate([prompts[0][:32]], warm)
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True, detokenize=not args.disable_detokenize)
              for o in olens]
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    stats = llm.get_stats()
    llm.close()
    from servetwin.gpu.cpu_kernels import decode_kernel  # noqa: PLC0415 - in-process executor: the same module state
    kernels = "native CPU kernels" if decode_kernel() is not None else "no native CPU kernels (pure torch)"
    return {"name": "servetwin (torch backend)", "wall_s": wall, "cpu_s": cpu, "load_s": load_s, "tokens": tokens,
            "extra": f"max_num_seqs={args.batch_size}, {blocks} KV blocks, "
                     f"{'token ids only (no detokenization)' if args.disable_detokenize else 'detokenized'}, "
                     f"max_model_len={max_model_len}, preemptions={stats.get('num_preemptions')}, {kernels}"}


def load_hf(model_name: str, attn: str):
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from servetwin.gpu.models.registry import resolve_model  # noqa: PLC0415

    path = resolve_model(model_name).path
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation=attn,
                                                 local_files_only=True).eval()
    model.generation_config.eos_token_id = None  # ignore EOS: never stop, never mask
    return model


def run_hf_generate(args, prompts, olens, pad_id: int) -> dict[str, Any]:
    from transformers import GenerationConfig  # noqa: PLC0415

    t0 = time.perf_counter()
    model = load_hf(args.model, "sdpa")
    load_s = time.perf_counter() - t0

    def batch_generate(idx: list[int]) -> list[list[int]]:
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            n = len(prompts[i])
            ids[row, width - n:] = torch.tensor(prompts[i])
            mask[row, width - n:] = 1
        new = max(olens[i] for i in idx)
        gc = GenerationConfig(do_sample=False, max_new_tokens=new, pad_token_id=pad_id)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, generation_config=gc)
        assert out.shape[1] == width + new, "HF generate stopped early (EOS not disabled?)"
        return [out[row, width:width + olens[i]].tolist() for row, i in enumerate(idx)]

    batch_generate([0])  # warm-up (small)
    if args.hf_grouping == "length":
        order = sorted(range(len(prompts)), key=lambda i: (-olens[i], i))
    else:  # "input": batches in request order, as a naive static batcher would
        order = list(range(len(prompts)))
    batches = [order[k:k + args.batch_size] for k in range(0, len(order), args.batch_size)]
    tokens: list[Optional[list[int]]] = [None] * len(prompts)
    generated = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for idx in batches:
        for i, toks in zip(idx, batch_generate(idx)):
            tokens[i] = toks
        generated += len(idx) * max(olens[i] for i in idx)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    del model
    return {"name": "HF generate (padded batches)", "wall_s": wall, "cpu_s": cpu, "load_s": load_s, "tokens": tokens,
            "extra": f"batch={args.batch_size}, "
                     + ("grouped by output length" if args.hf_grouping == "length" else "batches in input order")
                     + ", left padding, "
                     f"{generated} tokens generated for {sum(olens)} requested "
                     f"({generated / sum(olens) - 1:.1%} waste)"}


def run_hf_continuous(args, prompts, olens) -> dict[str, Any]:
    from transformers import GenerationConfig  # noqa: PLC0415

    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: PLC0415
    except ImportError as e:
        return {"name": "HF continuous batching", "skipped": f"not in this transformers: {e}"}
    t0 = time.perf_counter()
    model = load_hf(args.model, args.cb_attn)
    if not hasattr(model, "continuous_batching_context_manager"):
        return {"name": "HF continuous batching", "skipped": "model has no continuous_batching_context_manager"}
    load_s = time.perf_counter() - t0
    gc = GenerationConfig(do_sample=False, max_new_tokens=max(olens), eos_token_id=-1, pad_token_id=0)
    # the KV capacity servetwin's pool has (run_servetwin): unset, HF sizes its cache from the host's memory
    # (90% of all RAM on the CPU) and allocating that takes a minute, while B requests use only this much
    page = ContinuousBatchingConfig().page_size
    cbc = ContinuousBatchingConfig(max_requests_per_batch=args.batch_size,
                                   num_blocks=-(-kv_pool_blocks(args, prompts, olens) * 16 // page))

    def run(ps, os_, prefix):
        res: dict[str, Any] = {}
        with model.continuous_batching_context_manager(generation_config=gc, continuous_batching_config=cbc,
                                                       block=True, timeout=5) as mgr:
            ids = [mgr.add_request(p, request_id=f"{prefix}{i}", max_new_tokens=o, eos_token_id=-1)
                   for i, (p, o) in enumerate(zip(ps, os_))]
            deadline = time.perf_counter() + 3600
            while len(res) < len(ids):
                r = mgr.get_result(timeout=1)
                if r is not None and r.is_finished():
                    if r.error is not None:
                        raise RuntimeError(f"request {r.request_id} failed: {r.error}")
                    res[r.request_id] = r
                elif r is None and not mgr.is_running():
                    raise RuntimeError("the continuous-batching thread stopped")
                if time.perf_counter() > deadline:
                    raise TimeoutError("continuous batching did not finish in an hour")
        return [list(res[f"{prefix}{i}"].generated_tokens) for i in range(len(ps))]

    try:
        run([prompts[0][:32]], [4], "warm")
        t0, c0 = time.perf_counter(), time.process_time()
        tokens = run(prompts, olens, "req")
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    except Exception as e:  # noqa: BLE001 - report why, keep the other results
        return {"name": "HF continuous batching", "skipped": f"failed on this machine: {type(e).__name__}: {e}"}
    attn = getattr(model.config, "_attn_implementation", "?")
    del model
    return {"name": "HF continuous batching", "wall_s": wall, "cpu_s": cpu, "load_s": load_s, "tokens": tokens,
            "extra": f"max_requests_per_batch={args.batch_size}, attention {attn}"}


# -- report ---------------------------------------------------------------------------------------------
def compare(ref: list[list[int]], other: list[list[int]]) -> dict[str, Any]:
    exact, first_diff = 0, []
    for a, b in zip(ref, other):
        if a == b:
            exact += 1
            continue
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        first_diff.append(k / max(len(a), 1))
    return {"exact": exact, "total": len(ref), "fraction": exact / len(ref),
            "mean_first_diff": float(np.mean(first_diff)) if first_diff else None}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--min-output", type=int, default=32)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16,
                    help="servetwin max_num_seqs = HF generate batch = HF CB max_requests_per_batch")
    ap.add_argument("--num-gpu-blocks", type=int, default=None, help="servetwin KV pool, and HF continuous batching's capacity (default: fits a full batch)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--hf-grouping", choices=["length", "input"], default="length",
                    help="HF generate batches: sorted by output length (default, the stronger baseline) or in "
                         "input order (each batch runs to its longest request)")
    ap.add_argument("--cb-attn", default="sdpa", help="attn_implementation for HF continuous batching")
    ap.add_argument("--skip", action="append", default=[], choices=["hf", "cb"])
    ap.add_argument("--no-cpu-kernels", action="store_true",
                    help="servetwin without its native CPU kernels (SERVETWIN_CPU_KERNELS=0): the pure-torch path")
    ap.add_argument("--disable-detokenize", action="store_true",
                    help="servetwin returns token ids only (SamplingParams.detokenize=False, vLLM's "
                         "benchmark_throughput flag), like HF generate, which never detokenizes")
    ap.add_argument("--json", default=None, help="write the figures to this file")
    args = ap.parse_args(argv)
    args.min_output = min(args.min_output, args.max_output)
    args.min_prompt = min(args.min_prompt, args.max_prompt)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.no_cpu_kernels:
        os.environ["SERVETWIN_CPU_KERNELS"] = "0"  # read when the kernels are first needed (executor start)

    from servetwin.gpu.models.registry import resolve_model  # noqa: PLC0415

    info = resolve_model(args.model)
    vocab = info.decoder_config.vocab_size
    pad_id = int(getattr(info.hf_config, "pad_token_id", None) or 0)
    prompts, olens = make_workload(args, vocab)
    print(f"model {args.model} (CPU, float32, {torch.get_num_threads()} threads); {len(prompts)} requests, "
          f"prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens (total {sum(map(len, prompts))}), "
          f"outputs {min(olens)}-{max(olens)} tokens (total {sum(olens)}), seed {args.seed}; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)

    def timed(fn, *a) -> dict[str, Any]:
        """Run one system; note the load average around it (other jobs on a shared machine skew it)."""
        load0 = os.getloadavg()[0]
        r = fn(*a)
        r["load"] = (load0, os.getloadavg()[0])
        msg = f"skipped: {r['skipped']}" if "skipped" in r else f"done in {r['wall_s']:.1f}s"
        print(f"  {r['name']} {msg} (load average {load0:.2f} -> {r['load'][1]:.2f})", flush=True)
        return r

    results = [timed(run_servetwin, args, prompts, olens)]
    if "hf" not in args.skip:
        results.append(timed(run_hf_generate, args, prompts, olens, pad_id))
    if "cb" not in args.skip:
        results.append(timed(run_hf_continuous, args, prompts, olens))

    out_tokens = sum(olens)
    ref = results[0]
    for r in results:
        if "skipped" in r:
            continue
        assert [len(t) for t in r["tokens"]] == olens, f"{r['name']}: output lengths differ from the requested ones"
        r["tok_s"] = out_tokens / r["wall_s"]
    print()
    print(f"{'system':32s} {'wall s':>8s} {'out tok/s':>10s} {'servetwin x':>12s} {'cpu s':>8s} "
          f"{'x by cpu s':>10s}  greedy ids equal to servetwin")
    summary: dict[str, Any] = {"requests": len(prompts), "output_tokens": out_tokens,
                               "prompt_tokens": sum(map(len, prompts)), "batch_size": args.batch_size,
                               "threads": torch.get_num_threads(), "systems": {}}
    for r in results:
        if "skipped" in r:
            print(f"{r['name']:32s} skipped: {r['skipped']}")
            summary["systems"][r["name"]] = {"skipped": r["skipped"]}
            continue
        ratio = ref["tok_s"] / r["tok_s"]
        eq = compare(ref["tokens"], r["tokens"]) if r is not ref else None
        eq_s = "-" if eq is None else (f"{eq['exact']}/{eq['total']} requests ({eq['fraction']:.0%})"
                                       + ("" if eq["mean_first_diff"] is None
                                          else f", first difference at {eq['mean_first_diff']:.0%} "
                                               "of the output on average where they differ"))
        cpu_ratio = r["cpu_s"] / ref["cpu_s"]
        print(f"{r['name']:32s} {r['wall_s']:8.1f} {r['tok_s']:10.1f} {ratio:11.2f}x {r['cpu_s']:8.1f} "
              f"{cpu_ratio:9.2f}x  {eq_s}")
        print(f"{'':32s} ({r['extra']}; model load {r['load_s']:.1f}s untimed; "
              f"load average {r['load'][0]:.2f} -> {r['load'][1]:.2f})")
        summary["systems"][r["name"]] = {"wall_s": r["wall_s"], "output_tok_s": r["tok_s"],
                                         "servetwin_speedup": ratio, "cpu_s": r["cpu_s"],
                                         "servetwin_speedup_by_cpu_time": cpu_ratio, "equality": eq, "notes": r["extra"],
                                         "load_average": r["load"]}
    targets = {"HF generate (padded batches)": 2.0, "HF continuous batching": 1.0}
    print()
    for name, target in targets.items():
        s = summary["systems"].get(name)
        if s is None or "skipped" in s:
            continue
        verdict = "met" if s["servetwin_speedup"] >= target else "MISSED"
        print(f"target servetwin >= {target:g}x {name}: {s['servetwin_speedup']:.2f}x ({verdict})")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
