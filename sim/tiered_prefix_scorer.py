"""The precise prefix-cache scorer over both tiers of an instance: its engines' GPU prefix cache and their CPU
offload tier (llm-d's precise prefix-cache scorer keeps, per block key, the pods and the device tier that
reported it stored through vLLM's KV events; vLLM 0.33's OffloadingConnector publishes its CPU tier's
stores and evictions with medium "CPU" in the same stream).

Score of an endpoint: walk the prompt's leading blocks (at most `max_blocks`) while the endpoint holds each
one in either tier; a block held on the GPU counts `gpu_weight`, one held only in the CPU tier `cpu_weight`;
the sum over the prompt's blocks. Both weights default to 1 (a CPU-tier hit counts as a GPU hit); a lower
`cpu_weight` prefers the instance that needs no load from the CPU tier. Events reach the index
`event_delay_s` after the step that made them, as the GPU ones (`sim/routers.py`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from servetwin.core.kv_cache.hashing import make_block_hash_with_group_id
from servetwin.sim.routers import Endpoint, PrecisePrefixCacheScorer


@dataclass(slots=True)
class TieredPrefixCacheScorer(PrecisePrefixCacheScorer):
    gpu_weight: float = 1.0
    cpu_weight: float = 1.0
    cpu_index: dict[int, set] = field(default_factory=dict)
    wants_cpu_kv_events: bool = True

    def on_cpu_kv_events(self, endpoint: int, events: Sequence[tuple[str, Any]]) -> None:
        """("stored" | "removed", block hash) of the endpoint's CPU tier. The tier keys a chunk by the
        block's hash; the GPU index by (hash, KV cache group): a CPU tier holds full-attention group 0."""
        keys = self.cpu_index.setdefault(endpoint, set())
        for kind, block_hash in events:
            key = make_block_hash_with_group_id(block_hash, 0)
            if kind == "stored":
                keys.add(key)
            else:
                keys.discard(key)

    def score(self, request: Any, endpoints: Sequence[Endpoint]) -> list[float]:
        out = []
        for e, keys in zip(endpoints, self.endpoint_keys(request, endpoints)):
            gpu, cpu = self.index.get(e.index, ()), self.cpu_index.get(e.index, ())
            total = 0.0
            for k in keys:
                if k in gpu:
                    total += self.gpu_weight
                elif k in cpu:
                    total += self.cpu_weight
                else:
                    break
            out.append(total / len(keys) if keys else 0.0)
        return out


__all__ = ["TieredPrefixCacheScorer"]
