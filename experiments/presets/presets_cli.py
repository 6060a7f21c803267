"""`servetwin presets`: the simulator's model and hardware presets with their key figures."""
from __future__ import annotations

import argparse
import json
from typing import Any


def model_rows() -> list[dict[str, Any]]:
    from servetwin.core.kv_cache.kv_cache_planning import describe_kv_plan, model_kv_plan  # noqa: PLC0415
    from servetwin.sim.model_spec import ALIASES, PRESETS  # noqa: PLC0415

    rows = []
    for name, s in PRESETS.items():
        rows.append({"name": name, "params_b": s.num_parameters / 1e9,
                     "active_b": s.num_active_parameters() / 1e9,
                     "experts": f"{s.num_experts_per_tok}/{s.num_experts}" if s.is_moe else "-",
                     "quant": f"{s.expert_dtype} experts" if s.expert_dtype else s.dtype,
                     "layers": s.num_layers,
                     "hidden": s.hidden_size, "heads": s.num_heads, "kv_heads": s.num_kv_heads,
                     "head_dim": s.head_dim, "intermediate": s.intermediate_size, "vocab": s.vocab_size,
                     "dtype": s.dtype, "weights_gib": s.weight_bytes / 2**30,
                     "kv_kib_per_token": s.kv_bytes_per_token() / 1024, "max_len": s.max_position_embeddings,
                     "kv_cache_groups": describe_kv_plan(model_kv_plan(s)),
                     "aliases": sorted(a for a, t in ALIASES.items() if t == name)})
    return rows


def hardware_rows() -> list[dict[str, Any]]:
    from servetwin.experiments.presets.validation import preset_validation  # noqa: PLC0415
    from servetwin.sim.hardware_presets import HARDWARE_PRESETS  # noqa: PLC0415

    rows = []
    for name, h in HARDWARE_PRESETS.items():
        fitted, validated = preset_validation(name)
        rows.append({"name": name, "device": h["device_type"], "bf16_tflops": h["peak_flops_bf16"] / 1e12,
                     "fp32_tflops": h["peak_flops_fp32"] / 1e12, "mem_bw_tb_s": h["memory_bandwidth"] / 1e12,
                     "memory_gib": h["memory_bytes"] / 2**30,
                     "fp8_tflops": h.get("peak_flops_fp8", 0.0) / 1e12, "fp4_tflops": h.get("peak_flops_fp4", 0.0) / 1e12,
                     "interconnect_gb_s": h["interconnect_bandwidth"] / 1e9,
                     "calibrated": fitted, "validated_on": validated})
    return rows


def _table(rows: list[dict[str, Any]], cols: list[tuple[str, str, str]]) -> str:
    cells = [[format(r[k], f) if f else ({True: "yes", False: "no"}.get(r[k], str(r[k])) if isinstance(r[k], bool)
                                          else str(r[k])) for k, _, f in cols] for r in rows]
    heads = [h for _, h, _ in cols]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
    line = lambda vals: "  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(vals, widths)))  # noqa: E731
    return "\n".join([line(heads), line(["-" * w for w in widths])] + [line(c) for c in cells])


MODEL_COLS = [("name", "model", ""), ("params_b", "params (B)", ".2f"), ("active_b", "active (B)", ".2f"),
              ("experts", "top-k/experts", ""), ("quant", "weights", ""), ("layers", "layers", ""),
              ("hidden", "hidden", ""), ("heads", "heads", ""), ("kv_heads", "kv heads", ""),
              ("intermediate", "intermediate", ""), ("vocab", "vocab", ""), ("weights_gib", "weights (GiB)", ".1f"),
              ("kv_kib_per_token", "KV/token (KiB)", ".1f"), ("max_len", "max len", ""),
              ("kv_cache_groups", "attention: KV cache groups", "")]
HW_COLS = [("name", "hardware", ""), ("device", "device", ""), ("bf16_tflops", "bf16 TFLOP/s", ".1f"),
           ("fp8_tflops", "fp8", ".0f"), ("fp4_tflops", "fp4", ".0f"),
           ("mem_bw_tb_s", "HBM TB/s", ".2f"), ("memory_gib", "memory (GiB)", ".1f"),
           ("interconnect_gb_s", "link GB/s", ".0f"), ("calibrated", "fitted on its runs", "")]


def _cmd(args: argparse.Namespace) -> int:
    models, hardware = model_rows(), hardware_rows()
    if args.json:
        print(json.dumps({"models": models, "hardware": hardware}, indent=2))
        return 0
    if args.kind in (None, "models"):
        print("Model presets (`model:`; published config.json values, weights and KV in the preset's dtype):\n")
        print(_table(models, MODEL_COLS))
        print("\nAlso accepted: the Hugging Face names (e.g. meta-llama/Llama-3.1-8B-Instruct) and any local "
              "config.json folder.")
    if args.kind is None:
        print()
    if args.kind in (None, "hardware"):
        print("Hardware presets (`hardware:`; vendor datasheet peaks; cost-model fractions fitted on published "
              "runs of that GPU only where marked, else carried over from another GPU's fit):\n")
        print(_table(hardware, HW_COLS))
        print("\nValidated on (median |error| against published vLLM runs, docs/published_vllm.md):")
        for h in hardware:
            print(f"  {h['name']}: {h['validated_on']}")
        print("\nA model too big for one device: engine.tensor_parallel_size (e.g. llama-3.1-405b: 756 GiB of "
              "weights, TP 8 on h200).")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("presets", help="list the model and hardware presets with their key figures")
    p.add_argument("kind", nargs="?", choices=["models", "hardware"], help="only one of the two tables")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd)
