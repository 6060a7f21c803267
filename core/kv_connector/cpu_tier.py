"""The CPU tier behind the offloading connector: vLLM 0.33's `CPUOffloadingManager` with its LRU and
ARC cache policies (`v1/kv_offload/cpu/manager.py`, `policies/lru.py`, `policies/arc.py`), one chunk
per GPU block.

A chunk is written by a store job (not readable until the store completes), read by load jobs (pinned
while one runs) and evicted only when neither. LRU recency is logical: a request keeps one rank while
it runs, its chunks ordered tail before head, and its finish commits the order.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable, Optional, Sequence

OffloadKey = bytes  # a block hash + its KV cache group's index


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """A block of one KV cache group in the CPU tier (vLLM 0.33 `v1/kv_offload/base.py:30-32`)."""
    return block_hash + group_idx.to_bytes(4, "big")


class LookupResult(Enum):
    MISS = 0
    HIT = 1
    HIT_PENDING = 2  # stored, the store not yet complete


class ChunkStatus:
    """One CPU slot: `ref_cnt` -1 while being written, else the loads reading it."""
    __slots__ = ("chunk_id", "ref_cnt")

    def __init__(self, chunk_id: int) -> None:
        self.chunk_id = chunk_id
        self.ref_cnt = -1

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0


@dataclass(slots=True)
class RequestContext:
    """Per request: where each of its keys ends (tokens) and the tier's per-request state."""
    positions: dict[OffloadKey, int] = field(default_factory=dict)
    rank: Optional[int] = None  # LRU: the request's provisional recency rank
    key_groups: list[OffloadKey] = field(default_factory=list)  # keys observed, head to tail
    seen_keys: set[OffloadKey] = field(default_factory=set)
    store_miss_keys: set[OffloadKey] = field(default_factory=set)
    inserted_keys: set[OffloadKey] = field(default_factory=set)  # chunks this request stored
    reused_keys: set[OffloadKey] = field(default_factory=set)  # ready chunks it read or offered again
    finished: bool = False


class LRUPolicy:
    """vLLM's LRU policy: a lazy min-heap of (rank, -position) over the evictable chunks."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self._ranks: dict[OffloadKey, tuple[int, int]] = {}
        self._evictable: set[OffloadKey] = set()
        self._heap: list[tuple[tuple[int, int], OffloadKey]] = []
        self._next_rank = 0

    def _request_rank(self, ctx: RequestContext) -> int:
        if ctx.rank is None:
            self._next_rank += 1
            ctx.rank = self._next_rank
        return ctx.rank

    def _push(self, key: OffloadKey) -> None:
        heapq.heappush(self._heap, (self._ranks[key], key))

    def _compact(self, force: bool = False) -> None:
        if force or len(self._heap) >= max(64, 2 * len(self._evictable)):
            self._heap = [(self._ranks[k], k) for k in self._evictable]
            heapq.heapify(self._heap)

    def _update_heap(self, updated: Sequence[OffloadKey]) -> None:
        if not updated:
            return
        if len(updated) >= max(64, len(self._evictable) // 4):
            self._compact(force=True)
        else:
            for key in updated:
                self._push(key)
            self._compact()

    def get(self, key: OffloadKey) -> Optional[ChunkStatus]:
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, ctx: RequestContext) -> None:
        self.chunks[key] = chunk
        position = ctx.positions.get(key)
        if position is None:
            self._next_rank += 1
            self._ranks[key] = (self._next_rank, 0)
        else:
            self._ranks[key] = (self._request_rank(ctx), -position)
        if chunk.ref_cnt == 0:
            self._evictable.add(key)
            self._push(key)

    def remove(self, key: OffloadKey) -> None:
        del self.chunks[key]
        self._ranks.pop(key, None)
        self._evictable.discard(key)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        updated = []
        for key in keys:
            if key in self.chunks:
                self._next_rank += 1
                self._ranks[key] = (self._next_rank, 0)
                if key in self._evictable:
                    updated.append(key)
        self._update_heap(updated)

    def on_store_miss(self, keys: Sequence[OffloadKey], ctx: RequestContext) -> None:
        self.touch(reversed(list(keys)))

    def on_request_access(self, keys: Sequence[OffloadKey], ctx: RequestContext) -> None:
        rank = self._request_rank(ctx)
        updated = []
        for key in keys:
            position = ctx.positions.get(key)
            if position is None or key not in self.chunks:
                continue
            new = (rank, -position)
            if self._ranks[key] >= new:
                continue
            self._ranks[key] = new
            if key in self._evictable:
                updated.append(key)
        self._update_heap(updated)

    def on_request_finished(self, keys: Sequence[OffloadKey], insertion_only: set[OffloadKey],
                            reused: set[OffloadKey], ctx: RequestContext) -> None:
        self.touch(reversed(list(keys)))  # head ends most recent

    def evict(self, n: int, protected: set[OffloadKey]) -> Optional[list[tuple[OffloadKey, ChunkStatus]]]:
        """n evictable chunks, oldest first, or None (nothing changes) when there are not enough."""
        if n == 0:
            return []
        selected, selected_keys, deferred = [], set(), []
        while self._heap and len(selected) < n:
            entry = heapq.heappop(self._heap)
            rank, key = entry
            if key not in self._evictable or self._ranks.get(key) != rank or key in selected_keys:
                continue
            if key in protected:
                deferred.append(entry)
                continue
            selected.append((entry, self.chunks[key]))
            selected_keys.add(key)
        if len(selected) < n:
            for entry in [e for e, _ in selected] + deferred:
                heapq.heappush(self._heap, entry)
            return None
        for entry in deferred:
            heapq.heappush(self._heap, entry)
        out = []
        for (rank, key), chunk in selected:
            self._evictable.remove(key)
            del self.chunks[key]
            del self._ranks[key]
            out.append((key, chunk))
        self._compact()
        return out

    def mark_evictable(self, key: OffloadKey) -> None:
        self._evictable.add(key)
        self._push(key)
        self._compact()

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._evictable.remove(key)


class ARCPolicy:
    """vLLM's ARC: T1 (seen once) and T2 (reused) with ghost lists B1 / B2 steering the target T1
    size; new chunks enter T1, a request's reuse promotes them to T2 when it finishes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.target_t1_size = 0.0
        self.t1: OrderedDict[OffloadKey, ChunkStatus] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, ChunkStatus] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()

    def get(self, key: OffloadKey) -> Optional[ChunkStatus]:
        return self.t1.get(key) or self.t2.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, ctx: RequestContext) -> None:
        self.t1[key] = chunk
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def remove(self, key: OffloadKey) -> None:
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)

    def _adapt_to_ghost_hit(self, key: OffloadKey) -> None:
        if key in self.b1:
            self.target_t1_size = min(self.target_t1_size + max(1, len(self.b2) / len(self.b1)), self.capacity)
            self.b1.move_to_end(key)
        elif key in self.b2:
            self.target_t1_size = max(self.target_t1_size - max(1, len(self.b1) / len(self.b2)), 0)
            self.b2.move_to_end(key)

    def on_store_miss(self, keys: Sequence[OffloadKey], ctx: RequestContext) -> None:
        for key in reversed(list(keys)):
            self._adapt_to_ghost_hit(key)

    def on_request_access(self, keys: Sequence[OffloadKey], ctx: RequestContext) -> None:
        return

    def on_request_finished(self, keys: Sequence[OffloadKey], insertion_only: set[OffloadKey],
                            reused: set[OffloadKey], ctx: RequestContext) -> None:
        for key in reversed(list(keys)):
            if key in insertion_only:
                if key in self.t1:
                    self.t1.move_to_end(key)
                elif key in self.t2:
                    self.t2.move_to_end(key)
            elif key in reused and key in self.t1:
                self.t2[key] = self.t1.pop(key)
            elif key in reused and key in self.t2:
                self.t2.move_to_end(key)

    def evict(self, n: int, protected: set[OffloadKey]) -> Optional[list[tuple[OffloadKey, ChunkStatus]]]:
        """T1 while it is at least its target, else T2, else T1; evicted keys become ghosts."""
        if n == 0:
            return []
        chosen: list[tuple[OffloadKey, ChunkStatus, bool]] = []
        t1_size = len(self.t1)
        t1_iter, t2_iter = iter(self.t1.items()), iter(self.t2.items())

        def next_candidate(entries):
            for key, chunk in entries:
                if chunk.ref_cnt == 0 and key not in protected:
                    return key, chunk
            return None

        for _ in range(n):
            pick = None
            if t1_size >= int(self.target_t1_size):
                entry = next_candidate(t1_iter)
                if entry is not None:
                    pick, t1_size = (*entry, True), t1_size - 1
            if pick is None:
                entry = next_candidate(t2_iter)
                if entry is not None:
                    pick = (*entry, False)
            if pick is None:
                entry = next_candidate(t1_iter)
                if entry is None:
                    return None
                pick, t1_size = (*entry, True), t1_size - 1
            chosen.append(pick)
        out = []
        for key, chunk, from_t1 in chosen:
            if from_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
            out.append((key, chunk))
        for ghost in (self.b1, self.b2):
            for _ in range(len(ghost) - self.capacity):
                ghost.popitem(last=False)
        return out

    def mark_evictable(self, key: OffloadKey) -> None:
        return

    def mark_non_evictable(self, key: OffloadKey) -> None:
        return


POLICIES = {"lru": LRUPolicy, "arc": ARCPolicy}


class CPUOffloadingManager:
    """The CPU tier: `num_chunks` slots under a cache policy; `store_threshold` >= 2 stores a chunk
    only once it was offered that many times."""

    def __init__(self, num_chunks: int, policy: str = "lru", store_threshold: int = 0,
                 max_tracker_size: int = 64_000) -> None:
        self.num_chunks = num_chunks
        self._policy = POLICIES[policy](num_chunks)
        self._num_allocated = 0
        self._free_list: list[int] = []
        self._num_evictable = 0
        self._num_write_pending = 0
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self.counts: Optional[OrderedDict[OffloadKey, int]] = OrderedDict() if store_threshold >= 2 else None
        # vLLM's OffloadingEvents (medium CPU): a chunk stored once its store completes, removed when evicted
        # (v1/kv_offload/cpu/manager.py:346-353, :392-420); None: off (vLLM: without --kv-events-config)
        self.events: Optional[list[tuple[str, OffloadKey]]] = None

    def _num_free(self) -> int:
        return len(self._free_list) + self.num_chunks - self._num_allocated

    def _allocate(self, n: int) -> list[ChunkStatus]:
        fresh = min(n, self.num_chunks - self._num_allocated)
        chunks = []
        for _ in range(fresh):
            chunks.append(ChunkStatus(self._num_allocated))
            self._num_allocated += 1
        for _ in range(n - fresh):
            chunks.append(ChunkStatus(self._free_list.pop()))
        return chunks

    def _record_accesses(self, keys: Sequence[OffloadKey]) -> None:
        """The store threshold's offer counts (bounded, oldest unprotected dropped first)."""
        counts = self.counts
        protected = set()
        for key in keys:
            if key in counts:
                counts.move_to_end(key)
                counts[key] += 1
                protected.add(key)
        unprotected = len(counts) - len(protected)
        for key in keys:
            if key in counts:
                continue
            if len(counts) >= self.max_tracker_size:
                if unprotected == 0:
                    continue
                counts.popitem(last=False)
                unprotected -= 1
            counts[key] = 1

    def _record_request_access(self, keys: Iterable[OffloadKey], ctx: RequestContext,
                               reused: Iterable[OffloadKey] = ()) -> None:
        ctx.reused_keys.update(k for k in reused if k not in ctx.inserted_keys)
        new = []
        for key in keys:
            if key not in ctx.seen_keys:
                ctx.key_groups.append(key)
                ctx.seen_keys.add(key)
                new.append(key)
        if new:
            self._policy.on_request_access(new, ctx)

    def lookup(self, key: OffloadKey) -> LookupResult:
        chunk = self._policy.get(key)
        if chunk is None:
            return LookupResult.MISS
        return LookupResult.HIT if chunk.is_ready else LookupResult.HIT_PENDING

    def chunk_ids(self, keys: Sequence[OffloadKey]) -> tuple[int, ...]:
        """The CPU slots holding `keys` (the worker side's copy addresses)."""
        return tuple(self._policy.get(k).chunk_id for k in keys)

    def prepare_load(self, keys: Sequence[OffloadKey], ctx: RequestContext) -> None:
        """Pin the chunks a load reads."""
        for key in keys:
            chunk = self._policy.get(key)
            assert chunk is not None and chunk.is_ready, key
            if chunk.ref_cnt == 0:
                self._policy.mark_non_evictable(key)
                self._num_evictable -= 1
            chunk.ref_cnt += 1
        self._record_request_access(keys, ctx, reused=keys)

    def complete_load(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            chunk = self._policy.get(key)
            chunk.ref_cnt -= 1
            if chunk.ref_cnt == 0:
                self._num_evictable += 1
                self._policy.mark_evictable(key)

    def prepare_store(self, keys: Sequence[OffloadKey], ctx: RequestContext) -> Optional[list[OffloadKey]]:
        """The keys a store job writes (room made by eviction), or None: no room."""
        keys = list(keys)
        if self.counts is not None:
            self._record_accesses(keys)
        to_store, ready = [], []
        for key in keys:
            chunk = self._policy.get(key)
            if chunk is None:
                to_store.append(key)
            elif chunk.is_ready:
                ready.append(key)
        if self.counts is not None:
            to_store = [k for k in to_store if self.counts.get(k, 0) >= self.store_threshold]
        misses = [k for k in to_store if k not in ctx.store_miss_keys]
        if misses:
            self._policy.on_store_miss(misses, ctx)
            ctx.store_miss_keys.update(misses)
        recorded = set(to_store) | set(ready)
        self._record_request_access([k for k in keys if k in recorded], ctx, reused=ready)
        if not to_store:
            return []
        evict = len(to_store) - self._num_free()
        if evict > 0:
            if evict > self._num_evictable:
                return None
            evicted = self._policy.evict(evict, set(keys))
            if evicted is None:
                return None
            self._num_evictable -= len(evicted)
            for key, chunk in evicted:
                self._free_list.append(chunk.chunk_id)
                if self.events is not None:
                    self.events.append(("removed", key))
        for key, chunk in zip(to_store, self._allocate(len(to_store))):
            self._policy.insert(key, chunk, ctx)
        self._num_write_pending += len(to_store)
        ctx.inserted_keys.update(to_store)
        return to_store

    def complete_store(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            chunk = self._policy.get(key)
            if chunk is not None and not chunk.is_ready:
                chunk.ref_cnt = 0
                self._num_write_pending -= 1
                self._num_evictable += 1
                self._policy.mark_evictable(key)
                if self.events is not None:
                    self.events.append(("stored", key))

    def on_request_finished(self, ctx: RequestContext) -> None:
        if ctx.finished:
            return
        ctx.finished = True
        keys = list(ctx.key_groups)
        if all(k in ctx.positions for k in keys):
            keys.sort(key=ctx.positions.__getitem__)
        self._policy.on_request_finished(keys, ctx.inserted_keys - ctx.reused_keys, ctx.reused_keys, ctx)
