"""The CUDA-graph decode path without a GPU: the graph runner's padding, pad block, full-width key
padding and static-metadata copies, replayed eagerly on the CPU (only the capture itself is skipped)."""
from __future__ import annotations

import random

import torch

from servetwin.core.sched.config import CacheConfig, SchedulerConfig
from servetwin.core.engine.engine_core import EngineCore
from servetwin.core.request import Request
from servetwin.core.sampling_params import SamplingParams
from servetwin.gpu.cuda_graphs import CudaGraphRunner, default_capture_sizes, width_buckets
from backend_helpers import check_step_logits, make_executor, oracle


class EagerReplayRunner(CudaGraphRunner):
    """`capture` keeps only the static metadata; `_replay` runs the model on the static buffers."""

    def capture(self) -> None:
        self.replayed: set[tuple[int, int]] = set()
        for width in self.widths:
            for bs in self.capture_sizes:
                self.graphs[(bs, width)] = (None, self.static_metadata(bs, width), None)

    def _replay(self, key: tuple[int, int]) -> torch.Tensor:
        self.replayed.add(key)
        bs = key[0]
        return self.model(self.input_ids[:bs], self.positions[:bs], self.kv_caches, self.graphs[key][1])


def test_default_capture_sizes_and_widths():
    assert default_capture_sizes(128) == [1, 2, 4, *range(8, 129, 8)]
    assert default_capture_sizes(6) == [1, 2, 4, 6]
    assert default_capture_sizes(1000)[-1] == 256
    assert width_buckets(512) == [32, 128, 512]
    assert width_buckets(64) == [16, 64] and width_buckets(10) == [10]


def test_padded_decode_replay_matches_hf():
    name = "tiny-qwen3"
    ex, orc = make_executor(name, num_gpu_blocks=40, max_model_len=160), oracle(name)
    runner = EagerReplayRunner(ex.model, ex.attn_backend, ex.kv_caches, ex.block_size, ex.pad_block_id,
                               ex.max_model_len, ex.device, [1, 2, 4, 8], min_width_blocks=2)
    runner.capture()
    assert runner.widths == [2, 10]
    ex.graph_runner = runner
    eng = EngineCore(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=160),
                     CacheConfig(block_size=16, num_gpu_blocks=ex.num_gpu_blocks), ex)
    rng = random.Random(2)
    lens = [5, 18, 40, 9, 27, 4, 11]
    arrivals = {0: [0, 1, 2, 3, 4], 40: [5, 6]}  # the late pair decodes alone, within 2 blocks
    padded_sizes = set()
    for s in range(200):
        for i in arrivals.get(s, []):
            eng.add_request(Request(f"c{i}", [rng.randrange(3, 320) for _ in range(lens[i])],
                                    SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True)))
        if not eng.has_work():
            continue
        res = eng.step()
        so, out = res.scheduled, res.model_output
        if so is None or so.is_empty:
            continue
        check_step_logits(ex, orc, so, out)
        q = list(so.num_scheduled_tokens.values())
        if max(q) == 1:  # decode-only: replayed at the padded size
            padded_sizes.add((len(q), out.timing.padded_batch_size))
    assert {(5, 8), (3, 4), (1, 1), (2, 2)} <= padded_sizes, padded_sizes
    assert {(8, 10), (4, 10), (2, 2)} <= runner.replayed, runner.replayed
    # the pad block took the padded rows' writes; real blocks were checked against HF above
    assert ex.kv_caches[0][0][ex.pad_block_id].abs().sum() > 0
