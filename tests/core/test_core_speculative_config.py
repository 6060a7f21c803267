"""vLLM's `speculative_config` as users give it (LLM kwargs, --speculative-config JSON, experiment
YAML), and the engine loop's draft hand-off (`EngineCore.post_step`) with vLLM's counters."""
from __future__ import annotations

import pytest

from servetwin.core.config_error import ConfigError
from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_core import EngineCore
from servetwin.core.engine.executor import FakeExecutor
from servetwin.core.engine.metrics import ServingMetrics
from servetwin.core.engine.messages import EngineStats
from servetwin.core.engine.engine_client import spec_decode_totals
from servetwin.core.outputs import ModelRunnerOutput
from servetwin.core.request import Request
from servetwin.core.sampling_params import SamplingParams
from servetwin.core.sched.config import CacheConfig, SchedulerConfig
from servetwin.core.sched.spec_decode import DraftTokenIds, SpeculativeConfig


def test_ngram_window_defaults_follow_vllm():
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 2}).prompt_lookup_min == 5
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    c = SpeculativeConfig.from_dict('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)


@pytest.mark.parametrize("raw, path", [
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
    ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "method": "medusa"}, "speculative_config.method"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "speculative_config.prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": "x"}, "speculative_config.prompt_lookup_max"),
    ({"num_speculative_tokens": 2, "method": "draft_model"}, "speculative_config.model"),
    ({"num_speculative_tokens": 2, "lookup": 3}, "speculative_config.lookup"),
    ("{not json", "speculative_config"),
    ([1], "speculative_config"),
])
def test_bad_speculative_config_names_the_field(raw, path):
    with pytest.raises(ConfigError) as e:
        EngineArgs.from_kwargs(backend="fake", speculative_config=raw)
    assert e.value.path == path


def test_draft_model_reserves_lookahead_slots_like_vllm():
    c = SpeculativeConfig.from_dict({"method": "draft_model", "num_speculative_tokens": 4, "model": "m"})
    assert c.num_lookahead_tokens == 4 and c.num_prefill_lookahead_tokens == 0
    assert c.num_hash_lookahead_tokens(True) == 0
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 4}).num_lookahead_tokens == 0


class EchoDrafter(FakeExecutor):
    """Drafts [t, t] after each sampled token t and accepts the first draft of every verified row."""

    def __init__(self) -> None:
        super().__init__()
        self.pending = None

    def execute_model(self, so):
        out = super().execute_model(so)
        for i, rid in enumerate(out.req_ids):
            drafts = so.scheduled_spec_decode_tokens.get(rid)
            if drafts and out.sampled_token_ids[i]:
                out.sampled_token_ids[i] = [drafts[0]] + out.sampled_token_ids[i]
        self.pending = DraftTokenIds(out.req_ids, [[t[-1], t[-1]] if t else [] for t in out.sampled_token_ids])
        return out

    def take_draft_token_ids(self):
        drafts, self.pending = self.pending, None
        return drafts


def test_post_step_feeds_drafts_and_counts_them():
    core = EngineCore(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64),
                      CacheConfig(block_size=4, num_gpu_blocks=64), EchoDrafter(),
                      speculative_config=SpeculativeConfig(num_speculative_tokens=2))
    core.add_request(Request("a", list(range(10, 18)), SamplingParams(max_tokens=9, ignore_eos=True)))
    outputs = []
    while core.has_work():
        result = core.step()
        outputs += [t for o in result.outputs for t in o.new_token_ids]
        if result.scheduled is not None and result.scheduled.scheduled_spec_decode_tokens:
            assert result.scheduled.num_scheduled_tokens["a"] == 3  # 1 + k drafts verified per step
    assert len(outputs) == 9
    totals = spec_decode_totals(core)
    # steps: prefill (1 token), then 4 verify steps of 2 drafts, 1 accepted each -> 2 tokens a step
    assert totals["spec_decode_num_drafts"] == 4 and totals["spec_decode_num_draft_tokens"] == 8
    assert totals["spec_decode_num_accepted_tokens_per_pos"] == [4, 0]
    met = ServingMetrics("m")
    met.update_engine(EngineStats(**totals))
    text = met.render()
    assert 'vllm:spec_decode_num_drafts_total{model_name="m",engine="0"} 4.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",engine="0",position="0"} 4.0' in text


def test_no_speculation_no_spec_metrics():
    met = ServingMetrics("m")
    met.update_engine(EngineStats())
    assert "spec_decode" not in met.render()
