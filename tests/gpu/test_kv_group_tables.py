"""The per-layer plan interface for hybrid KV-cache groups: tiny-gpt-oss with its sliding layers on one
block table (out-of-window entries replaced by the null block 0, as a sliding-window group does) and its
full layers on another, equals HF; block 0 and the freed blocks hold NaN in the sliding layers' caches."""
from __future__ import annotations

import numpy as np
import torch

from servetwin.gpu.attention import CommonAttentionMetadata, TorchPagedAttention
from servetwin.gpu.attention.layer_plans import build_layer_metadata
from servetwin.gpu.loader import load_model
from servetwin.gpu.models.tiny import TINY_GPT_OSS_WINDOW
from backend_helpers import oracle

BS = 4


def _common(table: list[int], start: int, n: int) -> CommonAttentionMetadata:
    """One request: tokens [start, start + n) over `table`."""
    pos = np.arange(start, start + n)
    slots = np.array([table[p // BS] * BS + p % BS for p in pos], dtype=np.int64)
    qsl = np.array([0, n], dtype=np.int32)
    sl = np.array([start + n], dtype=np.int32)
    bt = torch.tensor([table], dtype=torch.int32)
    return CommonAttentionMetadata(num_reqs=1, num_actual_tokens=n, max_query_len=n, max_seq_len=start + n,
                                   block_size=BS, query_start_loc=torch.from_numpy(qsl), seq_lens=torch.from_numpy(sl),
                                   block_table=bt, slot_mapping=torch.from_numpy(slots), query_start_loc_cpu=qsl,
                                   seq_lens_cpu=sl)


@torch.inference_mode()
def test_sliding_and_full_layers_on_their_own_group_tables():
    model = load_model("tiny-gpt-oss")
    cfg = model.config
    backend = TorchPagedAttention("batched", cfg.num_heads // cfg.num_kv_heads, mask_dtype=torch.float32)
    model.set_attention_backend(backend)
    windows = model.layer_windows
    layer_group = [0 if not w.is_full else 1 for w in windows]
    assert layer_group == [0, 1]
    caches = [(torch.zeros(40, BS, cfg.num_kv_heads, cfg.head_dim), torch.zeros(40, BS, cfg.num_kv_heads, cfg.head_dim))
              for _ in range(cfg.num_layers)]
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 320, 30).tolist()
    sliding = list(range(1, 9))  # group 0: 8 blocks for the 30-token prompt
    full = list(range(20, 28))  # group 1
    pos, n = 0, len(tokens)
    orc = oracle("tiny-gpt-oss")
    for step in range(6):
        commons = [_common(sliding, pos, n), _common(full, pos, n)]
        meta = build_layer_metadata(backend, commons, windows, layer_group)
        assert isinstance(meta, list) and meta[0] is not meta[1]
        hidden = model(torch.tensor(tokens[pos:pos + n]), torch.arange(pos, pos + n), caches, meta)
        logits = model.compute_logits(hidden[-1:])[0]
        torch.testing.assert_close(logits, orc.last_logits(tokens), atol=2e-5, rtol=1e-5)
        tokens.append(int(logits.argmax()))
        pos, n = pos + n, 1
        # the sliding group frees the blocks before the next query's window: null block in the table,
        # NaN in the cache (a freed block may be handed to another request)
        first = max(0, pos - TINY_GPT_OSS_WINDOW + 1) // BS
        for b in range(first):
            if sliding[b]:
                caches[0][0][sliding[b]] = float("nan")
                caches[0][1][sliding[b]] = float("nan")
                sliding[b] = 0
        caches[0][0][0] = float("nan")
        caches[0][1][0] = float("nan")
        if pos // BS >= len(sliding):
            sliding.append(9 + step)
            full.append(28 + step)
    assert sliding[:4] == [0, 0, 0, 0]
