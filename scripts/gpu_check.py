"""GPU checks of the torch backend (run by scripts/gpu_check.sh on a CUDA machine).

1. Backend selection: with flash-attn not importable, `auto` picks torch-paged (block sizes 16, 256).
2. CUDA graphs on vs off: identical greedy tokens (fp32 tiny-llama) via the real scheduler; the bf16
   agreement rate is reported too.
3. Greedy tokens equal HF `generate` on the GPU (fp32 tiny-qwen3).
4. bf16 throughput of a SmolLM2-135M-shaped model with random weights (graphs on and off).
5. Tensor parallelism: TP=2 with NCCL when two GPUs exist (gloo in the CPU dry run) gives TP=1's greedy
   tokens (fp32 tiny-llama); one GPU: TP=1 only.
6. torch-paged batched vs loop attention micro-benchmark (bf16).
Writes `gpu_check.json` under $OUT (or ./gpu_check_out). Exit status 1 if a check fails.
A CPU dry run of the script itself: GPU_CHECK_DEVICE=cpu GPU_CHECK_SMALL=1 (graphs are not used there).
"""
from __future__ import annotations

import gc
import json
import logging
import os
import random
import subprocess
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402

from servetwin.core.sched.config import CacheConfig, SchedulerConfig  # noqa: E402
from servetwin.core.engine.engine_core import EngineCore  # noqa: E402
from servetwin.core.request import Request  # noqa: E402
from servetwin.core.sampling_params import SamplingParams  # noqa: E402
from servetwin.gpu.attention.flash_attn import import_flash_attn  # noqa: E402
from servetwin.gpu.executor import TorchExecutor  # noqa: E402

DEV = os.environ.get("GPU_CHECK_DEVICE", "cuda")
SMALL = os.environ.get("GPU_CHECK_SMALL") == "1"
OUT = Path(os.environ.get("OUT") or "gpu_check_out")
OUT.mkdir(parents=True, exist_ok=True)
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                    handlers=[logging.StreamHandler(), logging.FileHandler(OUT / "gpu_check.log")])
log = logging.getLogger("gpu_check")
results: dict = {"torch": torch.__version__, "cuda": torch.version.cuda,
                 "device": torch.cuda.get_device_name(0) if DEV == "cuda" else DEV, "flash_attn_importable": import_flash_attn() is not None,
                 "checks": {}}


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def generate(ex: TorchExecutor, prompts: list[list[int]], max_tokens: int, max_num_seqs: int = 64,
             budget: int = 2048) -> tuple[dict[str, list[int]], list, float]:
    eng = EngineCore(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                     max_model_len=ex.max_model_len),
                     CacheConfig(block_size=ex.block_size, num_gpu_blocks=ex.num_gpu_blocks), ex)
    for i, p in enumerate(prompts):
        eng.add_request(Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    timings = []
    sync()
    t0 = time.perf_counter()
    while eng.has_work():
        res = eng.step()
        if res.model_output is not None and res.model_output.timing is not None and res.scheduled is not None:
            q = list(res.scheduled.num_scheduled_tokens.values())
            if q:
                timings.append((len(q), max(q), res.model_output.timing))
        for o in res.outputs:
            out[o.request_id].extend(o.new_token_ids)
    sync()
    return out, timings, time.perf_counter() - t0


def prompts_of(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def check(name: str):
    def wrap(fn):
        t = time.perf_counter()
        try:
            res = fn()
            ok = bool(res.pop("ok", True))
        except Exception as e:  # record and go on with the other checks
            res, ok = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}, False
        res["ok"], res["seconds"] = ok, round(time.perf_counter() - t, 2)
        results["checks"][name] = res
        log.info("CHECK %s: %s %s", name, "PASS" if ok else "FAIL", {k: v for k, v in res.items() if k != "traceback"})
        (OUT / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
        return fn
    return wrap


@check("backend_selection")
def _():
    got = {}
    for bs in (16, 256):
        ex = TorchExecutor("tiny-llama", device=DEV, dtype="bfloat16", block_size=bs, num_gpu_blocks=128,
                           max_model_len=1024 if bs == 16 else 4096, enforce_eager=True)
        got[bs] = ex.attention_backend_name
    expect = "torch-paged" if not results["flash_attn_importable"] else "flash-attn"
    return {"selected": got, "ok": got[16] == "torch-paged" and got[256] == expect}


@check("cuda_graphs_vs_eager")
def _():
    res = {}
    for dtype in ("float32", "bfloat16"):
        prompts = prompts_of([3, 17, 40, 64, 100, 7, 33, 250, 12, 90, 5, 61][:4 if SMALL else 12], 320, seed=1)
        outs = {}
        for eager in (True, False):
            ex = TorchExecutor("tiny-llama", device=DEV, dtype=dtype, num_gpu_blocks=512, max_model_len=1024,
                               enforce_eager=eager, max_num_seqs=16, seed=0)
            outs[eager], timings, _ = generate(ex, prompts, 48, max_num_seqs=16, budget=256)
            if not eager:
                res[f"{dtype}_padded_sizes"] = sorted({(n, t.padded_batch_size) for n, q, t in timings if q == 1})
        same = sum(outs[True][k] == outs[False][k] for k in outs[True])
        res[f"{dtype}_identical_requests"] = f"{same}/{len(prompts)}"
        if dtype == "float32":
            res["ok"] = same == len(prompts)
    return res


@check("greedy_equals_hf_generate_on_gpu")
def _():
    from transformers import AutoModelForCausalLM
    ex = TorchExecutor("tiny-qwen3", device=DEV, dtype="float32", num_gpu_blocks=256, max_model_len=1024)
    hf = AutoModelForCausalLM.from_pretrained(str(ex.model_info.path), dtype=torch.float32,
                                              attn_implementation="eager", local_files_only=True).to(DEV).eval()
    prompts = prompts_of([4, 30, 77, 150], 320, seed=2)
    got, _, _ = generate(ex, prompts, 24)
    bad = []
    for i, p in enumerate(prompts):
        ids = torch.tensor([p], device=DEV)
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24,
                          do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        if ref != got[f"r{i}"]:
            bad.append(i)
    return {"mismatching_prompts": bad, "ok": not bad}


def smollm2_shaped_model_dir() -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM
    d = Path(os.environ.get("TMPDIR", "/tmp")) / "servetwin_random_smollm2"
    if not (d / "config.json").exists():
        cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                          rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                          tie_word_embeddings=True, eos_token_id=2, bos_token_id=1, rms_norm_eps=1e-5)
        torch.manual_seed(0)
        with torch.device(DEV):
            model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        model.save_pretrained(d)
    return d


@check("bf16_throughput_smollm2_shaped")
def _():
    path = str(smollm2_shaped_model_dir())
    res = {}
    n_req, prompt_len, out_len = (4, 16, 8) if SMALL else (64, 128, 128)
    prompts = prompts_of([prompt_len] * n_req, 49152, seed=3)
    for eager in (False, True):
        ex = TorchExecutor(path, device=DEV, dtype="bfloat16", max_model_len=1024, max_num_seqs=n_req,
                           max_num_batched_tokens=4096, enforce_eager=eager, gpu_memory_utilization=0.5)
        generate(ex, prompts[:4], 4, max_num_seqs=n_req, budget=4096)  # warm-up
        _, timings, wall = generate(ex, prompts, out_len, max_num_seqs=n_req, budget=4096)
        dec = [t for n, q, t in timings if q == 1]
        key = "eager" if eager else "cuda_graphs"
        res[key] = {
            "num_gpu_blocks": ex.num_gpu_blocks, "attention": ex.attention_backend_name,
            "wall_s": round(wall, 3), "output_tok_per_s": round(n_req * out_len / wall, 1),
            "decode_steps": len(dec),
            "decode_step_ms_mean": round(1e3 * sum(t.duration_s for t in dec) / max(1, len(dec)), 3),
            "decode_forward_ms_mean": round(1e3 * sum(t.forward_s for t in dec) / max(1, len(dec)), 3),
            "decode_padded_sizes": sorted({t.padded_batch_size for t in dec}),
        }
        del ex
        gc.collect()
        if DEV == "cuda":
            torch.cuda.empty_cache()
    return res


@check("tensor_parallel")
def _():
    """TP=2 (NCCL on two GPUs; gloo in the CPU dry run) against one process: identical greedy tokens
    (fp32 tiny-llama). One GPU: TP=1 only, which the checks above cover."""
    from servetwin.gpu.multiproc_executor import MultiprocExecutor
    tp = 2 if DEV == "cpu" or torch.cuda.device_count() >= 2 else 1
    if tp == 1:
        return {"tensor_parallel_size": 1, "note": f"{torch.cuda.device_count()} GPU(s): TP=2 needs two"}
    kwargs = dict(model="tiny-llama", device=DEV, dtype="float32", num_gpu_blocks=512, max_model_len=1024,
                  max_num_seqs=16, seed=0)
    prompts = prompts_of([3, 17, 40, 64, 100, 7, 33, 250][:4 if SMALL else 8], 320, seed=3)
    want, _, _ = generate(TorchExecutor(**kwargs), prompts, 32, max_num_seqs=16, budget=256)
    mp = MultiprocExecutor(tp, kwargs, threads=1 if DEV == "cpu" else None)
    try:
        got, _, secs = generate(mp, prompts, 32, max_num_seqs=16, budget=256)
        weights = [r.weight_bytes for r in mp.ready]
    finally:
        mp.close()
    same = sum(want[k] == got[k] for k in want)
    return {"tensor_parallel_size": tp, "backend": "nccl" if DEV == "cuda" else "gloo",
            "identical_requests": f"{same}/{len(prompts)}", "per_rank_weight_bytes": weights,
            "generate_seconds": round(secs, 3), "ok": same == len(prompts)}


@check("torch_paged_batched_vs_loop")
def _():
    cmd = [sys.executable, "benchmarks/torch_paged_attention.py", "--device", DEV, "--dtype", "bfloat16",
           "--reps", "2" if SMALL else "20"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONPATH": "."})
    return {"output": p.stdout.strip().splitlines(), "stderr_tail": p.stderr[-2000:], "ok": p.returncode == 0}


failed = [k for k, v in results["checks"].items() if not v["ok"]]
log.info("done: %d checks, failed: %s; results in %s", len(results["checks"]), failed, OUT / "gpu_check.json")
sys.exit(1 if failed else 0)
