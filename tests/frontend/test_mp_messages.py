"""Wire format of the engine-core process boundary, the toy tokenizer and the metrics text (no processes)."""
from __future__ import annotations

import math

import msgspec
import pytest

from servetwin.core.engine import messages as m
from servetwin.core.engine.metrics import ServingMetrics, parse_prometheus_text, sample
from servetwin.core.outputs import EngineCoreOutput, Logprobs
from servetwin.core.request import FinishReason
from servetwin.core.engine.request_output import RequestMetrics
from servetwin.core.sampling_params import RequestOutputKind, SamplingParams
from servetwin.core.engine.toy_tokenizer import ToyTokenizer
from frontend_utils import run_script


def _roundtrip_params(sp: SamplingParams) -> SamplingParams:
    wire = msgspec.msgpack.encode(m.encode_params(sp))
    return m.decode_params(msgspec.msgpack.decode(wire, type=m.SamplingParamsMsg))


def test_every_sampling_params_field_crosses_or_is_rejected():
    # A field added to SamplingParams later must be added to SamplingParamsMsg (or be rejected explicitly).
    missing = m.sampling_params_fields() - m.transferable_param_fields() - m.NOT_TRANSFERABLE
    assert not missing, f"SamplingParams fields that would be lost across processes: {sorted(missing)}"


def test_sampling_params_roundtrip_is_exact():
    sp = SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, seed=11, stop=["a", "bc"],
                        stop_token_ids=[7, 9], max_tokens=12, min_tokens=2, logprobs=3, prompt_logprobs=1,
                        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                        include_stop_str_in_output=True, output_kind=RequestOutputKind.DELTA,
                        extra_args={"k": [1, 2]})
    sp.update_from_generation_config([2, 5])
    back = _roundtrip_params(sp)
    for name in m.transferable_param_fields():
        assert getattr(back, name) == getattr(sp, name), name
    assert back.eos_token_id == 2 and back.all_stop_token_ids == {2, 5, 7, 9}
    assert back.stop_token_ids == [7, 9, 5]
    assert back.output_kind is RequestOutputKind.DELTA
    assert back.sampling_type == sp.sampling_type
    assert back.logits_processors is None


def test_greedy_params_roundtrip_keeps_normalisation():
    sp = SamplingParams(temperature=0.0, top_k=-1, max_tokens=None, ignore_eos=True)
    sp.update_from_generation_config([2])
    back = _roundtrip_params(sp)
    assert back.temperature == 0.0 and back.top_k == 0 and back.max_tokens is None
    assert back.eos_token_id is None and back.all_stop_token_ids == {2}


def test_logits_processors_cannot_cross():
    sp = SamplingParams(logits_processors=[lambda ids, logits: logits])
    with pytest.raises(ValueError, match=r"^logits_processors: .*multiprocess=False"):
        m.encode_params(sp)


def test_unencodable_extra_args_are_rejected():
    with pytest.raises(ValueError, match=r"^extra_args: "):
        m.encode_params(SamplingParams(extra_args={"f": object()}))


def test_outputs_message_roundtrip():
    outs = [EngineCoreOutput("a", [12, 13], None, None, [Logprobs([12, 3], [-0.1, -2.0], 0)], None, 16),
            EngineCoreOutput("b", [99], FinishReason.STOP, "xy", None, [None, Logprobs([4], [-1.5], 0)], 0)]
    msg = m.OutputsMsg(outs, m.EngineStats(1, 2, 0.25, 10, 100, 40, 3, 7), idle_seq=5,
                       errors=[m.RequestErrorMsg("c", "ValueError", "prompt: too long")], release_at=1.5)
    back = m.output_decoder().decode(m.encoder().encode(msg))
    assert isinstance(back, m.OutputsMsg)
    assert back.outputs == outs
    assert back.outputs[1].finished and back.outputs[1].finish_reason == FinishReason.STOP
    assert back.stats.prefix_cache_hits == 40 and back.idle_seq == 5 and back.release_at == 1.5
    assert back.errors[0].message == "prompt: too long"


def test_input_union_decodes_each_kind():
    enc, dec = m.encoder(), m.input_decoder()
    add = m.AddRequestMsg("r", [1, 2, 3], m.encode_params(SamplingParams(max_tokens=4)), None, 2, "salt", "p")
    for msg in (add, m.AbortMsg(["r"]), m.UtilityMsg(3, "get_stats", []), m.ShutdownMsg()):
        assert dec.decode(enc.encode(msg)) == msg


def test_toy_tokenizer():
    tok = ToyTokenizer(1024)
    assert tok.encode(" 12 7 1000") == [12, 7, 1000]
    assert tok.decode([12, 7]) == " 12 7"
    assert tok.decode(tok.encode("5 6 7")) == " 5 6 7"
    ids = tok.encode("hello world hello")
    assert ids[0] == ids[2] != ids[1] and all(10 <= i < 1024 for i in ids)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "user: hi\nassistant:"


def _progress(met: ServingMetrics, rid: str, n_tokens: int, finished: bool, now: float, reason=None) -> None:
    """One sample's state after a step, as the output processor reports it."""
    met.on_progress(rid, n_tokens, finished, [reason], RequestMetrics(), now)


def test_metrics_text_uses_vllm_names_and_counts_latencies():
    met = ServingMetrics("tiny")
    met.update_engine(m.EngineStats(num_running=2, num_waiting=1, kv_cache_usage=0.5, prefix_cache_queries=64,
                                    prefix_cache_hits=32, num_preemptions=4))
    met.on_arrival("r", 3, t=10.0)
    _progress(met, "r", 1, False, 10.2)   # TTFT 0.2
    _progress(met, "r", 3, False, 10.25)  # ITL 0.05
    _progress(met, "r", 4, True, 10.3, "length")  # ITL 0.05, E2E 0.3
    met.on_arrival("q", 5, t=11.0)
    met.on_abort("q")
    values = parse_prometheus_text(met.render())
    assert sample(values, "vllm:num_requests_running") == 2
    assert sample(values, "vllm:num_requests_waiting") == 1
    assert sample(values, "vllm:kv_cache_usage_perc") == 0.5
    assert sample(values, "vllm:prefix_cache_queries_total") == 64
    assert sample(values, "vllm:prefix_cache_hits_total") == 32
    assert sample(values, "vllm:num_preemptions_total") == 4
    assert sample(values, "vllm:generation_tokens_total") == 4
    assert sample(values, "vllm:prompt_tokens_total") == 8
    assert sample(values, "vllm:request_success_total", finished_reason="length") == 1
    assert sample(values, "vllm:request_success_total", finished_reason="abort") == 1
    assert sample(values, "vllm:time_to_first_token_seconds_count") == 1
    assert math.isclose(sample(values, "vllm:time_to_first_token_seconds_sum"), 0.2, abs_tol=1e-9)
    assert sample(values, "vllm:time_to_first_token_seconds_bucket", le="0.25") == 1
    assert sample(values, "vllm:time_to_first_token_seconds_bucket", le="0.1") == 0
    assert sample(values, "vllm:inter_token_latency_seconds_count") == 2
    assert sample(values, "vllm:e2e_request_latency_seconds_count") == 1
    assert sample(values, "vllm:e2e_request_latency_seconds_bucket", le="+Inf") == 1


def test_frontend_modules_do_not_import_torch_or_simpy():
    code = ("import sys; import servetwin.core.engine.mp_client, servetwin.core.engine.async_llm, servetwin.core.engine.engine_proc, servetwin.core.engine.metrics, "
            "servetwin.core.entrypoints.openai.api_server, servetwin.core.engine.llm, servetwin.experiments.serve.serve_cli; "
            "bad = [m for m in ('torch', 'simpy', 'transformers') if m in sys.modules]; print(bad)")
    res = run_script(code)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_ipc_calibration_file_matches_the_cost_model_names():
    from pathlib import Path

    import yaml

    path = Path(__file__).resolve().parents[2] / "experiments" / "calibrations" / "ipc_overhead.yaml"
    doc = yaml.safe_load(path.read_text())
    assert set(doc["coefficients"]) == {"c_ipc_step", "c_ipc_req"}
    assert doc["c_ipc_step_s"] == doc["coefficients"]["c_ipc_step"] > 0
    assert doc["c_ipc_req_s"] == doc["coefficients"]["c_ipc_req"] >= 0
    assert {"date", "machine", "python"} <= set(doc["provenance"])
    try:
        from servetwin.sim.coefficients import CostCoefficients
    except ImportError:
        return
    coeffs = CostCoefficients.from_dict(doc["coefficients"])
    assert coeffs.c_ipc_step == doc["c_ipc_step_s"] and coeffs.c_ipc_req == doc["c_ipc_req_s"]
