"""The llm-d gpt-oss-120b runs taken apart: one instance's step costs at the shapes the cluster cases give it.

`python benchmarks/published_cluster/decompose_steps.py` prints, for each per-instance shape of the published
cluster cases (benchmarks/published_cluster/cases), the predicted step time and its terms (`CostModel.basis`
times the preset's coefficients, ms), next to what the published figures imply for the same shape:

- routing arms, one H100 TP1 replica: a 6,500-token prompt prefilled whole (round robin: ~1% prefix hits),
  100 tokens after 6,400 cached / 612 after 5,888 (llm-d, 128-token blocks: ~98% hits), decode batches at ~6,750-token contexts
  (prompt + half the 500 output tokens);
- P/D arm: one H200 TP1 prefill instance's 5,000-token prefill, one H200 TP4 decode instance's batches at
  ~5,125-token contexts;
- the same step with the Marlin kernel of the training runs (benchmarks/published_moe), for comparison;
- the KV pool of each instance (tokens of full-attention KV it holds), which bounds the decode batch.

Implied figures (README.md here and its `published.json`): llm-d's `peakPrefillThroughput` (8,192 / median TTFT of
8,192-token prompts through the router: 39,065 tok/s on the routing arms' H100s, 33,821 through the P/D guide's
path; `calibrate_prefill.py` replays both); a decode step at the
P/D decode instances' batch follows from Little's law on the decoded-token basis (22.5 req/s x 250 tokens x
6.45 ms = 36 requests in flight per instance, one token per step each; the published TPOT 5.70 ms is per
client-counted token: pd_breakdown.py); the round-robin arm's TTFT at 3-15 req/s (176-184 ms)
bounds one 6,500-token prefill plus the front end.

The presets as they are (the Triton kernel's one fitted rate: sim/gpu_calibration.py, TRITON_MXFP4_FIT). Reading: docs/cost_model.md, "gpt-oss-120b
in the llm-d runs".
"""
from __future__ import annotations

from servetwin.sim.cost_model import CostModel, RowShape, StepSummary
from servetwin.sim.hardware import load_hardware
from servetwin.sim.kv_pool import size_kv_pool
from servetwin.sim.model_spec import load_model_spec

COUNTS = ("step", "req", "token", "layer", "layer_piecewise", "tp_step", "ipc_step", "ipc_req", "moe_layer")
COEFFICIENT = {"step": "c_step", "req": "c_req", "token": "c_token", "layer": "c_layer",
               "layer_piecewise": "c_layer_piecewise", "tp_step": "c_tp_step", "ipc_step": "c_ipc_step",
               "ipc_req": "c_ipc_req", "moe_layer": "c_moe_layer", "moe": "c_moe"}


def step_ms(cm: CostModel, rows: list[RowShape]) -> tuple[float, dict[str, float]]:
    """(the step's predicted duration, each term's share in ms: basis x its coefficient)."""
    st = StepSummary.from_rows(rows)
    c = cm.coefficients
    terms = {}
    for name, value in cm.basis(st).items():
        coef = getattr(c, COEFFICIENT.get(name, f"c_{name}"), 1.0)
        if value and coef:
            terms[name] = value * coef * 1e3
    return cm.predict(st).duration_s * 1e3, terms


def engine(hardware: str, tp: int, moe_backend: str = "triton") -> CostModel:
    """The cases' engine (async scheduling, vLLM's default MoE kernel on Hopper) or its Marlin twin."""
    return CostModel("gpt-oss-120b", hardware, tp=tp, async_scheduling=True, moe_backend=moe_backend)


def show(title: str, cm: CostModel, rows: list[RowShape], implied: str = "") -> None:
    total, terms = step_ms(cm, rows)
    marlin, _ = step_ms(engine(cm.hw.name, cm.tp, "marlin"), rows)
    parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(terms.items(), key=lambda kv: -kv[1]) if v >= 0.05)
    print(f"{title:<44} {total:8.2f} ms (Marlin {marlin:.2f})  {implied}")
    print(f"    {parts}")


def kv_tokens(hardware: str, tp: int, gpu_memory_utilization: float) -> int:
    """Full-attention KV tokens one instance's pool holds (the weights as the cases' MoE kernel lays them out)."""
    spec, hw = load_model_spec("gpt-oss-120b"), load_hardware(hardware)
    pool = size_kv_pool(spec, hw, 16, gpu_memory_utilization, 8192, 1024, tp, None, None,
                        weight_bytes=engine(hardware, tp).weight_bytes_per_rank)
    return pool.num_gpu_blocks * 16


def main() -> None:
    h100 = engine("h100-sxm", 1)
    print("== routing arms: one H100 TP1 replica (async scheduling, moe_backend triton; terms in ms, the "
          "engine's CPU terms overlap the GPU's) ==")
    show("prefill 6,500 tokens, nothing cached", h100, [RowShape(6500, 0)],
         "published TTFT at 3-15 req/s: 176-184 ms (front end included)")
    # llm-d: 128-token blocks (the guide's --block-size=128); a prompt sent again is cached to its last full block
    show("prefill 100 tokens after 6,400 cached (a prompt sent again)", h100, [RowShape(100, 6400)],
         "published TTFT at 3-15 req/s: 63-70 ms (llm-d)")
    show("prefill 612 tokens after 5,888 cached (a new prompt of a cached group)", h100, [RowShape(612, 5888)])
    for n in (16, 24, 32, 40):
        show(f"decode {n} x 6,750-token contexts", h100, [RowShape(1, 6750)] * n)
    print(f"KV pool (gpu_memory_utilization 0.95): {kv_tokens('h100-sxm', 1, 0.95):,} tokens")
    print("published llm-d plateau ~14.5k output tok/s over 16 replicas = ~900 tok/s per replica\n")

    print("== P/D arm: H200 instances (async scheduling) ==")
    h200_1 = engine("h200", 1)
    show("prefill TP1, 5,000 tokens", h200_1, [RowShape(5000, 0)])
    # llm-d's peakPrefillThroughput is 8,192 / TTFT through the router (calibrate_prefill.py replays it)
    show("prefill TP1, 8,192 tokens", h200_1, [RowShape(8192, 0)],
         f"EPP peakPrefillThroughput 33,821 tok/s: TTFT {8192 / 33821 * 1e3:.0f} ms through the P/D path")
    h200_4 = engine("h200", 4)
    for n in (16, 32, 36, 44, 64):
        show(f"decode TP4, {n} x 5,125-token contexts", h200_4, [RowShape(1, 5125)] * n,
             "published: 6.45 ms per decoded token at ~36 in flight" if n == 36 else "")
    print(f"KV pool TP4 (gpu_memory_utilization 0.9): {kv_tokens('h200', 4, 0.9):,} tokens")


if __name__ == "__main__":
    main()
