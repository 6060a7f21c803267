"""Cost model: hand-computed rooflines, monotonicity, CUDA-graph padding, tensor parallelism."""
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servetwin.core.config_error import ConfigError
from servetwin.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from servetwin.core.engine.runner_state import RunnerState
from servetwin.sim.coefficients import BASIS_TERMS, CostCoefficients
from servetwin.sim.cost_model import CostModel, RowShape, StepSummary, default_cuda_graph_sizes
from servetwin.sim.coefficients import Efficiency
from servetwin.sim.hardware import load_hardware
from servetwin.sim.model_spec import PRESETS


def ideal(name):
    """The preset's datasheet with ideal efficiencies (1.0, no shape dependence) and the pre-calibration
    placeholder overheads: the formula's rooflines checked by hand below."""
    hw = load_hardware(name)
    hw.efficiency = Efficiency()
    hw.coefficients = CostCoefficients(c_step=5e-4, c_req=1e-5, c_layer=2e-5)
    return hw

H100_BW, H100_PEAK = 3.35e12, 989.4e12
# llama-3.1-8b: d 4096, 32 layers, 32 heads, 8 KV heads, head dim 128, FFN 14336, vocab 128256.
L8_MATMUL = 4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336  # 218,103,808 per layer
L8_LAYER = L8_MATMUL + 2 * 4096


def test_llama_8b_layer_counts_used_below():
    m = PRESETS["llama-3.1-8b"]
    assert (m.layer_matmul_params, m.layer_params) == (L8_MATMUL, L8_LAYER)


def test_pure_decode_on_h100_is_bandwidth_bound():
    cm = CostModel("llama-3.1-8b", ideal("h100-sxm"))
    b = cm.basis([RowShape(q=1, s=1000)])
    assert b["linear"] == pytest.approx(32 * L8_LAYER * 2 / H100_BW)  # weights read once
    assert b["lm_head"] == pytest.approx((128256 * 4096 * 2 + 128256 * 4) / H100_BW)
    # KV of 1001 tokens read plus one token written, 32 layers x 8 heads x 128 x K/V x bf16
    assert b["attn_decode"] == pytest.approx(32 * 2 * 8 * 128 * 2 * (1001 + 1) / H100_BW)
    t = cm.predict([RowShape(q=1, s=1000)]).duration_s
    weights_over_bw = PRESETS["llama-3.1-8b"].weight_bytes / H100_BW  # ~4.8 ms
    assert weights_over_bw <= t <= 1.3 * weights_over_bw


def test_8k_prefill_on_h100_is_compute_bound():
    cm = CostModel("llama-3.1-8b", ideal("h100-sxm"))
    n = 8192
    b = cm.basis([RowShape(q=n, s=0)])
    linear_flops = 2 * n * 32 * L8_MATMUL
    attn_flops = 32 * 4 * 32 * 128 * (n * (n + 1) / 2)
    assert b["linear"] == pytest.approx(linear_flops / H100_PEAK)
    assert b["attn_prefill"] == pytest.approx(attn_flops / H100_PEAK)
    t = cm.predict([RowShape(q=n, s=0)]).duration_s
    flops_over_peak = (linear_flops + attn_flops + 2 * 4096 * 128256) / H100_PEAK  # ~134 ms
    assert flops_over_peak <= t <= 1.05 * flops_over_peak


def test_prefill_after_cached_prefix_attends_to_it():
    cm = CostModel("llama-3.1-8b", ideal("h100-sxm"))
    cold = cm.basis([RowShape(q=512, s=0)])["attn_prefill"]
    warm = cm.basis([RowShape(q=512, s=8192)])["attn_prefill"]
    assert warm == pytest.approx(cold * (512 * 8192 + 512 * 513 / 2) / (512 * 513 / 2))


def test_prediction_is_the_linear_combination_of_the_basis():
    cm = CostModel("qwen3-8b", ideal("a100-80g"), tp=2)
    rows = [RowShape(300, 4000, True), RowShape(1, 50, True), RowShape(1, 9000, True),
            RowShape(700, 0, False)]
    b = cm.basis(rows)
    assert set(b) == set(BASIS_TERMS)
    c = cm.coefficients
    timing = cm.predict(rows)
    assert timing.duration_s == pytest.approx(sum(c.for_term(k) * v for k, v in b.items()))
    assert timing.duration_s == pytest.approx(timing.prepare_s + timing.forward_s + timing.sample_s)
    assert timing.sample_s == pytest.approx(c.c_lm_head * b["lm_head"])


def test_sums_not_means_skewed_chunks_cost_more():
    cm = CostModel("llama-3.1-8b", ideal("h100-sxm"))
    even = cm.basis([RowShape(1000, 0), RowShape(1000, 0)])["attn_prefill"]
    skew = cm.basis([RowShape(1900, 0), RowShape(100, 0)])["attn_prefill"]
    assert skew > 1.5 * even  # sum q^2: 3.62e6 vs 2.0e6
    # decode attention is linear in each kv length: only the sum matters
    d1 = cm.basis([RowShape(1, 100), RowShape(1, 1900)])["attn_decode"]
    d2 = cm.basis([RowShape(1, 1000), RowShape(1, 1000)])["attn_decode"]
    assert d1 == pytest.approx(d2)


def test_lm_head_runs_only_for_sampling_rows():
    cm = CostModel("llama-3.1-8b", ideal("h100-sxm"))
    assert cm.basis([RowShape(512, 0, samples=False)])["lm_head"] == 0.0
    one = cm.basis([RowShape(512, 0, True)])["lm_head"]
    many = cm.basis([RowShape(1, 10, True)] * 2000)["lm_head"]
    assert many > one > 0


rows_strategy = st.lists(st.tuples(st.integers(1, 3000), st.integers(0, 20000), st.booleans()),
                         min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(rows=rows_strategy, extra=st.tuples(st.integers(1, 3000), st.integers(0, 20000)),
       which=st.integers(0, 39), grow=st.integers(1, 500), model=st.sampled_from(
           ["llama-3.1-8b", "qwen3-0.6b", "llama-3.1-70b"]), tp=st.sampled_from([1, 2, 4]))
def test_monotone_in_work_without_graphs(rows, extra, which, grow, model, tp):
    cm = CostModel(model, ideal("h100-sxm"), tp=tp, cuda_graphs=False)
    base = cm.predict(rows).duration_s
    # one more request
    assert cm.predict(rows + [(extra[0], extra[1], True)]).duration_s >= base
    # a longer cached context
    i = which % len(rows)
    q, s, smp = rows[i]
    longer_ctx = rows[:i] + [(q, s + grow, smp)] + rows[i + 1:]
    assert cm.predict(longer_ctx).duration_s >= base
    # more tokens in a chunk of the same phase (q > 1 stays > 1)
    if q > 1:
        more = rows[:i] + [(q + grow, s, smp)] + rows[i + 1:]
        assert cm.predict(more).duration_s >= base


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 600), s=st.integers(0, 5000))
def test_decode_batches_monotone_with_graphs(n, s):
    cm = CostModel("llama-3.1-8b", ideal("h100-sxm"), cuda_graphs=True)
    assert cm.predict([RowShape(1, s)] * (n + 1)).duration_s >= cm.predict([RowShape(1, s)] * n).duration_s


def test_cuda_graph_padding_of_decode_batches():
    cm = CostModel("llama-3.1-8b", ideal("h100-sxm"), cuda_graphs=True)
    assert cm.graph_sizes == default_cuda_graph_sizes(512)
    assert cm.graph_sizes[:5] == [1, 2, 4, 8, 16] and cm.graph_sizes[-1] == 512
    three = cm.predict([RowShape(1, 100)] * 3)
    assert three.padded_batch_size == 4
    b3 = cm.basis([RowShape(1, 100)] * 3)
    assert b3["layer"] == b3["layer_piecewise"] == 0.0  # full graph replay: no per-layer launches
    assert b3["token"] == 3.0  # host-side work is on real tokens
    # 300 decodes pad to 304; at that size the GEMMs are compute-bound on an H100
    b300 = cm.basis([RowShape(1, 100)] * 300)
    assert cm.predict([RowShape(1, 100)] * 300).padded_batch_size == 304
    assert b300["linear"] == pytest.approx(2 * 304 * 32 * L8_MATMUL / H100_PEAK)
    # above the largest captured size a step runs outside any graph, unpadded
    assert cm.predict([RowShape(1, 100)] * 513).padded_batch_size == 513
    big = cm.basis([RowShape(1, 100)] * 513)
    assert (big["layer"], big["layer_piecewise"]) == (0.0, 32.0)


def test_mixed_steps_pad_to_a_capture_size_in_piecewise_graphs():
    # vLLM V1 pads every step up to the largest capture size (pad_for_cudagraph); a step that is not a
    # uniform decode runs the piecewise graphs: padded GEMMs, attention launched per layer
    cm = CostModel("llama-3.1-8b", ideal("h100-sxm"), cuda_graphs=True)
    mixed = [RowShape(1, 100)] * 200 + [RowShape(100, 0)]  # 300 tokens
    assert cm.predict(mixed).padded_batch_size == 304
    b = cm.basis(mixed)
    assert (b["layer"], b["layer_piecewise"]) == (0.0, 32.0)
    assert b["linear"] == pytest.approx(2 * 304 * 32 * L8_MATMUL / H100_PEAK)
    assert b["token"] == 300.0  # host-side work and attention on the real tokens
    assert cm.predict([RowShape(600, 0)]).padded_batch_size == 600  # above 512: eager, unpadded
    # servetwin's torch backend runs such steps eagerly: a model of it does not pad them
    eager_mixed = CostModel("llama-3.1-8b", ideal("h100-sxm"), cuda_graphs=True, piecewise_graphs=False)
    assert eager_mixed.predict(mixed).padded_batch_size == 300
    assert eager_mixed.predict([RowShape(1, 100)] * 3).padded_batch_size == 4  # decode graphs stay
    wide = CostModel("llama-3.1-8b", ideal("h100-sxm"), cuda_graphs=True, graph_sizes=default_cuda_graph_sizes(2048))
    assert wide.predict([RowShape(1000, 0), RowShape(1, 5)]).padded_batch_size == 1008


def test_graphs_off_and_custom_sizes():
    off = CostModel("llama-3.1-8b", ideal("h100-sxm"), cuda_graphs=False)
    assert off.predict([RowShape(1, 100)] * 3).padded_batch_size == 3
    assert off.basis([RowShape(1, 100)] * 3)["layer"] == 32.0
    custom = CostModel("llama-3.1-8b", ideal("h100-sxm"), graph_sizes=[8, 1])
    assert custom.predict([RowShape(1, 100)] * 3).padded_batch_size == 8
    with pytest.raises(ValueError, match="cuda_graphs"):
        CostModel("tiny-llama", "cpu", cuda_graphs=True)
    assert CostModel("tiny-llama", "cpu").cuda_graphs is False


def test_tensor_parallel_terms():
    rows = [RowShape(1, 100)] * 64
    tp1 = CostModel("llama-3.1-70b", ideal("h100-sxm"), tp=1, cuda_graphs=False).basis(rows)
    tp4 = CostModel("llama-3.1-70b", ideal("h100-sxm"), tp=4, cuda_graphs=False).basis(rows)
    assert tp1["comm"] == 0.0
    lat, link = 8e-6, 450e9
    expected = (2 * 80 * (lat + 2 * 0.75 * 64 * 8192 * 2 / link)
                + lat + 0.75 * 64 * 128256 * 2 / link)
    assert tp4["comm"] == pytest.approx(expected)
    assert tp4["linear"] == pytest.approx(tp1["linear"] / 4)  # memory-bound: weights split
    # 8 KV heads: beyond tp=8 they are replicated, so per-rank KV traffic stops shrinking
    tp8 = CostModel("llama-3.1-70b", ideal("h100-sxm"), tp=8).basis(rows)["attn_decode"]
    tp16 = CostModel("llama-3.1-70b", ideal("h100-sxm"), tp=16).basis(rows)["attn_decode"]
    assert tp16 == pytest.approx(tp8)
    with pytest.raises(ValueError, match="tp: 3 must divide"):
        CostModel("llama-3.1-8b", ideal("h100-sxm"), tp=3)
    with pytest.raises(ValueError, match="interconnect"):
        CostModel("tiny-llama", "cpu", tp=2)


def test_ipc_terms_default_off():
    rows = [RowShape(1, 10)] * 5
    off = CostModel("qwen3-0.6b", ideal("h100-sxm")).basis(rows)
    on = CostModel("qwen3-0.6b", ideal("h100-sxm"), ipc=True).basis(rows)
    assert off["ipc_step"] == off["ipc_req"] == 0.0
    assert (on["ipc_step"], on["ipc_req"]) == (1.0, 5.0)
    coeffs = CostCoefficients(c_ipc_step=1e-3, c_ipc_req=1e-4)
    cm = CostModel("qwen3-0.6b", ideal("h100-sxm"), ipc=True, coefficients=coeffs)
    assert cm.predict(rows).prepare_s == pytest.approx(1e-3 + 5e-4)


def test_empty_step_costs_only_the_step_overhead():
    cm = CostModel("tiny-llama", "cpu")
    b = cm.basis([])
    assert b["step"] == 1.0 and sum(b.values()) == 1.0
    assert cm.predict([]).duration_s == pytest.approx(cm.coefficients.c_step)


def test_predict_from_scheduler_output_matches_rows():
    cm = CostModel("tiny-llama", "cpu")
    state = RunnerState()
    so0 = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", list(range(40)), None, ([1, 2, 3],), 0),
                            NewRequestData("b", list(range(20)), None, ([4, 5],), 16)],
        scheduled_cached_reqs=CachedRequestData(), num_scheduled_tokens={"a": 24, "b": 4},
        total_num_scheduled_tokens=28, finished_req_ids=set(), preempted_req_ids=set(), step=0,
        num_computed_before={"a": 0, "b": 16})
    rows = state.update(so0)
    expected = cm.predict([RowShape(24, 0, False), RowShape(4, 16, True)])
    assert cm.predict_from_scheduler_output(so0, rows) == expected
    # without rows every request is taken to sample
    assert cm.predict_from_scheduler_output(so0) == cm.predict([RowShape(24, 0), RowShape(4, 16)])
    so0.num_computed_before.pop("b")
    with pytest.raises(ValueError, match="num_computed_before"):
        cm.predict_from_scheduler_output(so0)


def test_step_summary_sums():
    s = StepSummary.from_rows([(3, 10, True), (1, 7, True), (5, 0, False)])
    assert (s.num_reqs, s.num_tokens, s.num_sampling) == (3, 9, 2)
    assert (s.prefill_reqs, s.prefill_sum_q, s.prefill_sum_q2, s.prefill_sum_q_s,
            s.prefill_sum_kv) == (2, 8, 34, 30, 18)
    assert (s.decode_reqs, s.decode_sum_kv) == (1, 8)
    with pytest.raises(ValueError, match="q >= 1"):
        StepSummary.from_rows([(0, 1, True)])


def test_shared_prefix_reads_have_their_own_term():
    """Shared KV tokens move from the decode (then prefill) bytes to `attn_shared`; priced alike they
    change nothing on a memory-bound step, priced lower they cost exactly the difference."""
    rows = [RowShape(1, 1000)] * 8 + [RowShape(64, 512)]
    plain = StepSummary.from_rows(rows)
    shared = dataclasses.replace(plain, shared_kv=6000)
    per_token = 32 * 2 * 8 * 128 * 2 / H100_BW  # llama-3.1-8b KV bytes per token / bandwidth
    cm = CostModel("llama-3.1-8b", ideal("h100-sxm"))
    b0, b1 = cm.basis(plain), cm.basis(shared)
    assert b0["attn_shared"] == 0.0
    assert b1["attn_shared"] == pytest.approx(6000 * per_token)
    assert b0["attn_decode"] - b1["attn_decode"] == pytest.approx(6000 * per_token)  # 8 x 1001 >= 6000
    assert cm.predict(shared).duration_s == pytest.approx(cm.predict(plain).duration_s)
    # more shared tokens than the decode rows read: the rest comes off the prefill rows' prefixes (512)
    over = dataclasses.replace(plain, shared_kv=8308)
    b2 = cm.basis(over)
    assert b2["attn_shared"] == pytest.approx((8008 + 300) * per_token)
    cheap = CostModel("llama-3.1-8b", ideal("h100-sxm"),
                      coefficients=dataclasses.replace(cm.coefficients, c_attn_shared=0.25))
    saved = cm.predict(shared).duration_s - cheap.predict(shared).duration_s
    assert saved == pytest.approx(0.75 * 6000 * per_token)


def test_the_scheduler_reports_shared_kv_tokens():
    """Two requests with a common 48-token prefix: 3 blocks with two holders each."""
    from servetwin.core.sched.config import CacheConfig, SchedulerConfig  # noqa: PLC0415
    from servetwin.core.request import Request  # noqa: PLC0415
    from servetwin.core.sampling_params import SamplingParams  # noqa: PLC0415
    from servetwin.core.sched.scheduler import Scheduler  # noqa: PLC0415

    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256),
                      CacheConfig(block_size=16, num_gpu_blocks=64, enable_prefix_caching=True))
    common = list(range(100, 148))
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    sched.add_request(Request("a", common + [1, 2, 3], sp, arrival_time=0.0))
    so = sched.schedule()
    assert so.shared_kv_tokens == 0
    sched.add_request(Request("b", common + [4, 5], sp, arrival_time=1.0))
    so = sched.schedule()
    assert so.shared_kv_tokens == 3 * 16


def test_gemm_efficiency_saturates_with_token_count():
    hw = ideal("h100-sxm")
    hw.efficiency = Efficiency(gemm_compute=0.5, gemm_half_m=100.0)
    cm = CostModel("llama-3.1-8b", hw, cuda_graphs=False)
    for m in (64, 1000, 8192):
        lin = cm.basis([RowShape(m, 0)])["linear"]
        flops = 2 * m * 32 * L8_MATMUL
        compute = flops / (H100_PEAK * 0.5 * m / (m + 100))  # e * M / (M + h) of the peak
        assert lin == pytest.approx(max(compute, 32 * L8_LAYER * 2 / H100_BW))
    # small token counts stay weight-bound; the achieved FLOP rate grows with M
    rate = [2 * m * 32 * L8_MATMUL / cm.basis([RowShape(m, 0)])["linear"] for m in (512, 2048, 8192)]
    assert rate[0] < rate[1] < rate[2] < 0.5 * H100_PEAK


def test_prefill_attention_efficiency_depends_on_keys_per_query():
    hw = ideal("h100-sxm")
    hw.efficiency = Efficiency(attn_prefill_compute=0.66, attn_prefill_half_kv=215.0)
    cm = CostModel("llama-3.1-8b", hw)
    short, long_prefix = cm.basis([RowShape(512, 0)])["attn_prefill"], cm.basis([RowShape(512, 16384)])["attn_prefill"]
    pairs_short, pairs_long = 512 * 513 / 2, 512 * 16384 + 512 * 513 / 2
    assert (pairs_long / long_prefix) > 1.5 * (pairs_short / short)  # a cached prefix runs nearer the peak


def test_decode_rows_beside_a_chunk_pay_padded_query_tiles():
    # FlashAttention-2's paged varlen call: beside a chunk each decode row costs r query rows per
    # query head at the prefill kernel's rate; a decode-only step keeps its bandwidth-bound price
    hw = ideal("a100-80g")
    hw.efficiency = Efficiency(attn_prefill_compute=0.5, attn_prefill_half_kv=300.0, attn_mixed_decode_rows=64.0)
    cm = CostModel("llama-3.1-8b", hw)
    plain = CostModel("llama-3.1-8b", ideal("a100-80g"))
    decodes = [RowShape(1, 3000)] * 10
    assert cm.basis(decodes)["attn_decode"] == pytest.approx(plain.basis(decodes)["attn_decode"])
    mixed = cm.basis(decodes + [RowShape(2048, 0)])["attn_decode"]
    padded = 32 * 4 * 32 * 128 * 64 * (10 * 3001 + 300.0 * 10) / (312e12 * 0.5)  # L*4*Hq*dh*r*(sum kv + h*n)
    assert mixed == pytest.approx(padded)
    assert mixed > 3 * plain.basis(decodes + [RowShape(2048, 0)])["attn_decode"]  # compute-bound now
    with pytest.raises(ConfigError, match="attn_mixed_decode_rows"):
        Efficiency(attn_mixed_decode_rows=-1.0)


def test_hopper_presets_pack_gqa_heads_beside_a_chunk():
    # FlashAttention-3 packs a KV head's query heads for paged KV in every call: no padded tiles
    for name in ("h100-sxm", "h200"):
        assert load_hardware(name).efficiency.attn_mixed_decode_rows == 0
    assert load_hardware("a100-80g").efficiency.attn_mixed_decode_rows == 64


def test_fp8_weights_and_kv_cache():
    hw = ideal("h100-sxm")
    bf16 = CostModel("llama-3.1-8b", hw)
    fp8 = CostModel("llama-3.1-8b", hw, quantization="fp8", kv_cache_dtype="fp8")
    decode = [RowShape(1, 4000)] * 8
    assert fp8.basis(decode)["linear"] == pytest.approx(bf16.basis(decode)["linear"] / 2)  # 1-byte weights
    assert fp8.basis(decode)["attn_decode"] == pytest.approx(bf16.basis(decode)["attn_decode"] / 2)  # 1-byte KV
    prefill = [RowShape(8192, 0)]
    assert fp8.basis(prefill)["linear"] == pytest.approx(bf16.basis(prefill)["linear"] / 2, rel=1e-3)  # fp8 peak
    a100 = CostModel("llama-3.1-8b", ideal("a100-80g"), quantization="fp8")  # no fp8 cores: W8A16
    assert a100.basis(prefill)["linear"] == pytest.approx(
        CostModel("llama-3.1-8b", ideal("a100-80g")).basis(prefill)["linear"])
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CostModel("llama-3.1-8b", hw, kv_cache_dtype="int4")


def test_fp8_gemms_reach_a_lower_fraction_and_pay_the_activation_quantisation():
    hw = ideal("h100-sxm")
    hw.efficiency = Efficiency(gemm_fp8_relative=0.883)
    bf16, fp8 = CostModel("llama-3.1-8b", hw), CostModel("llama-3.1-8b", hw, quantization="fp8")
    prefill = [RowShape(8192, 0)]
    assert bf16.basis(prefill)["linear"] / fp8.basis(prefill)["linear"] == pytest.approx(2 * 0.883, rel=1e-3)
    # W8A8: each GEMM input (d for qkv and gate/up, Hq*dh for o, dff for down) quantised, 5 bytes an element
    extra = 32 * 8192 * 5 * (2 * 4096 + 32 * 128 + 14336) / H100_BW
    assert fp8.basis(prefill)["elementwise"] - bf16.basis(prefill)["elementwise"] == pytest.approx(extra)
    decode = [RowShape(1, 500)] * 4  # the LM head is not quantised: same bf16 weights and peak
    assert fp8.basis(decode)["lm_head"] == pytest.approx(bf16.basis(decode)["lm_head"])
    assert fp8.basis(prefill)["lm_head"] == pytest.approx(bf16.basis(prefill)["lm_head"])
    a100 = ideal("a100-80g")  # no fp8 tensor cores: W8A16, activations stay bf16
    assert (CostModel("llama-3.1-8b", a100, quantization="fp8").basis(prefill)["elementwise"]
            == pytest.approx(CostModel("llama-3.1-8b", a100).basis(prefill)["elementwise"]))


def test_calibrated_presets_are_slower_than_the_datasheet():
    rows = [RowShape(1, 1000)] * 8
    ideal_t = CostModel("llama-3.1-8b", ideal("h100-sxm")).predict(rows).duration_s
    cal_t = CostModel("llama-3.1-8b", "h100-sxm").predict(rows).duration_s
    assert cal_t > ideal_t
    h100 = CostModel("llama-3.1-8b", "h100-sxm").predict(rows).duration_s
    h200 = CostModel("llama-3.1-8b", "h200").predict(rows).duration_s
    assert 1.0 < h100 / h200 < 4.8 / 3.35  # part of a decode step does not scale with bandwidth


# -- a measured GEMM curve (Efficiency.gemm_m_curve) ------------------------------------------------------
def _curve_hw(curve):
    from servetwin.sim.hardware import hardware_from_dict

    return hardware_from_dict({"base": "cpu", "name": "curve", "efficiency": {"gemm_m_curve": curve}})


def test_a_gemm_curve_sets_the_linear_term_at_every_token_count_dips_included():
    curve = [[1, 0.02], [8, 0.08], [10, 0.12], [16, 0.12], [64, 0.25]]
    hw = _curve_hw(curve)
    cm = CostModel("smollm2-135m", hw)
    m = cm.model
    flops = 2.0 * m.num_layers * m.layer_matmul_params
    weights = m.num_layers * m.layer_params * m.dtype_bytes / hw.memory_bandwidth
    for t, frac in [(1, 0.02), (8, 0.08), (9, 0.10), (10, 0.12), (16, 0.12), (40, 0.185), (64, 0.25), (300, 0.25)]:
        expect = max(flops * t / (hw.peak_flops(m.dtype) * frac), weights)
        assert cm.basis([(t, 0, True)])["linear"] == pytest.approx(expect, rel=1e-9), t
    # the dip is followed: 10 tokens cost less than 8 (a BLAS kernel switch), as measured
    assert cm.basis([(10, 0, True)])["linear"] < cm.basis([(8, 0, True)])["linear"]
    # through the hardware dict and back (YAML lists), and without a curve the smooth form is unchanged
    assert _curve_hw(hw.efficiency.to_dict()["gemm_m_curve"]).efficiency == hw.efficiency
    plain = CostModel("smollm2-135m", "cpu")
    assert "gemm_m_curve" not in plain.hw.efficiency.to_dict()


@pytest.mark.parametrize("curve, path, message", [
    ("fast", "hardware.efficiency.gemm_m_curve", "must be a list of [M, fraction] pairs"),
    ([[1, 0.1, 3]], "hardware.efficiency.gemm_m_curve[0]", "must be a pair"),
    ([[1, 1.5]], "hardware.efficiency.gemm_m_curve[0][1]", "must be <= 1"),
    ([[0, 0.5]], "hardware.efficiency.gemm_m_curve[0][0]", "must be > 0"),
    ([[4, 0.5], [2, 0.6]], "hardware.efficiency.gemm_m_curve[1][0]", "M must increase"),
])
def test_a_bad_gemm_curve_names_the_point(curve, path, message):
    with pytest.raises(ConfigError) as info:
        _curve_hw(curve)
    assert info.value.path == path and message in info.value.message


_FAST_PATH_MODELS: dict = {}


@settings(max_examples=200, deadline=None)
@given(model=st.sampled_from(["tiny-llama", "llama-3.1-8b", "gpt-oss-120b"]), tp=st.sampled_from([1, 2]),
       cuda_graphs=st.booleans(), async_scheduling=st.booleans(), ipc=st.booleans(),
       rows=st.lists(st.tuples(st.sampled_from([1, 1, 1, 2, 17, 600]), st.integers(0, 20_000), st.booleans()),
                     max_size=12),
       implicit=st.integers(0, 400), mean_s=st.integers(0, 9000), shared_frac=st.sampled_from([0.0, 0.3, 1.0, 2.0]))
def test_predict_decode_fast_path_equals_the_terms(model, tp, cuda_graphs, async_scheduling, ipc, rows, implicit,
                                                   mean_s, shared_frac):
    """`predict` prices a pure decode batch (every row one token, every row sampling) from its batch size's
    cached parts: the same `StepTiming` - duration, prepare, forward, sample seconds (floats compared with ==)
    and padded size - as `predict_by_terms`, for dense, MoE and sliding-window models, TP, graphs or eager, sync
    or async, listed and implicit rows, shared KV; any other step is `predict_by_terms`' too."""
    key = (model, tp, cuda_graphs, async_scheduling, ipc)
    if key not in _FAST_PATH_MODELS:  # (a batch size's parts cached by an earlier case: part of the claim)
        _FAST_PATH_MODELS[key] = CostModel(model, "h100-sxm", tp=tp, cuda_graphs=cuda_graphs, ipc=ipc,
                                           async_scheduling=async_scheduling)
    cm = _FAST_PATH_MODELS[key]
    qs, ss = [q for q, _, _ in rows], [s for _, s, _ in rows]
    sum_s = implicit * mean_s
    shared = int((sum(ss) + sum_s) * shared_frac)
    for num_sampling in {sum(sample for _, _, sample in rows), len(rows)}:
        summary = StepSummary.from_lists(qs, ss, num_sampling, implicit_decodes=implicit, implicit_sum_s=sum_s,
                                         shared_kv=shared)
        assert cm.predict(summary) == cm.predict_by_terms(summary)
