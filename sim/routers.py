"""Routers in front of a cluster's instances: which instance (endpoint) serves a request.

A router sees `Endpoint`s: each instance's metrics as last scraped (`waiting`, `running`, `kv_usage`: stale
by up to the scrape interval, 50 ms by default, GIE's `DefaultRefreshMetricsInterval`), and the router's own
exact in-flight bookkeeping (`active`, `active_tokens`). `route(request, endpoints)` returns a `RouteDecision`
(the pick and, when the router scores, every candidate's score: the cluster's decision table).

Built in (`ROUTERS`): `round_robin`, `random`, `least_loaded` and `llm_d`, the llm-d / Gateway API
Inference Extension pipeline: filters, then the weighted sum of scorers, then the max-score picker with a
random tie-break (llm-d-inference-scheduler `docs/architecture.md`, "Routing Flow"). Scorers (`SCORERS`):
- `queue`: min-max normalised waiting count, `(maxQ - q) / (maxQ - minQ)`, all equal -> 1 (GIE
  `scorer/queue.go`);
- `kv-cache-utilization`: `1 - kv_usage` (GIE `scorer/kvcache_utilization.go`);
- `load-aware`: `q == 0 -> 0.5`, else `0.5 * (1 - min(q, T) / T)`, T = 128 (llm-d `QueueThresholdDefault`);
- `active-request`: the router's in-flight count, `(max - n) / max`, all idle -> 1 (llm-d `active-request-scorer`);
- `token-load`: the router's in-flight prompt tokens, `1 - min(t, T) / T`, T = 4,194,304 (GIE
  `scorer/tokenload`, `tokenQueueThresholdDefault`, "128 requests @ 32K"); with the router's `in_flight_load`
  parameter, llm-d's in-flight load producer's count instead (`InFlightLoad`: uncached prompt tokens until the
  first token);
- `prefix-cache` (approximate): a router-side LRU index per endpoint of the block hashes of the prompts routed
  there (16-token blocks, at most 256 matched, 31,250 blocks per endpoint), which never sees the engines'
  evictions; score = leading blocks matched / prompt blocks (GIE `plugins/multi/prefix/plugin.go`);
- `precise-prefix-cache`: leading prompt blocks in an index of the blocks the endpoint's engines reported
  cached through vLLM's KV events (BlockStored / BlockRemoved / AllBlocksCleared), which reach the router
  `event_delay_s` after the step that made them (default 5 ms, assumed: llm-d does not publish it);
- `tiered-prefix-cache`: the same over the GPU cache and the endpoint's CPU offload tier (its events, medium CPU).
The filter `prefix-cache-affinity` keeps the endpoints whose approximate prefix score is at least `threshold`
(default 0.80; all endpoints when none is), unless its TTFT load gate opens (`PrefixAffinityFilter`).

Users add routers and scorers through the entry point groups `servetwin.routers` (a factory called with the
router's config and its random stream, as the built-in `make_*` ones) and `servetwin.router_scorers` (a factory
called with the scorer's parameters); the built-ins are registered there too (pyproject.toml) and found first.
"""
from __future__ import annotations

import importlib.metadata
from collections import OrderedDict
from itertools import takewhile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Protocol

import numpy as np

from servetwin.core.config_error import ConfigError
from servetwin.core.kv_cache.hashing import make_block_hash_with_group_id
from servetwin.core.prompt_memo import PromptMemo

ROUTER_ENTRY_POINTS = "servetwin.routers"
SCORER_ENTRY_POINTS = "servetwin.router_scorers"
DEFAULT_SCRAPE_INTERVAL_S = 0.05  # GIE cmd/epp: DefaultRefreshMetricsInterval = 50ms
LOAD_AWARE_THRESHOLD = 128  # llm-d QueueThresholdDefault
TOKEN_LOAD_THRESHOLD = 4_194_304  # GIE tokenload tokenQueueThresholdDefault
PREFIX_BLOCK_TOKENS = 16  # GIE prefix plugin: block size in tokens
PREFIX_MAX_BLOCKS = 256  # maxPrefixBlocksToMatch
PREFIX_LRU_BLOCKS = 31_250  # lruCapacityPerServer
# llm-d-router's `approx-prefix-cache-producer` (pkg/epp/framework/plugins/requestcontrol/dataproducer/
# approximateprefix at 7f6c33663, 2026-06-26): `defaultMaxPrefixTokens` (types.go:110, #1548 of 2026-06-11) and
# `minBlockSizeTokens` (plugin.go:50, #1160 of 2026-06-02)
PRODUCER_MAX_PREFIX_TOKENS = 131_072
PRODUCER_MIN_BLOCK_TOKENS = 64
# How long vLLM's KV events take to reach the router's index (ZMQ publish + indexer): not published; assumed.
KV_EVENT_DELAY_S = 0.005


@dataclass(slots=True)
class Endpoint:
    """One routable instance as the router sees it."""
    index: int
    name: str
    role: str = "both"
    waiting: int = 0  # scraped
    running: int = 0  # scraped
    kv_usage: float = 0.0  # scraped
    active: int = 0  # the router's requests in flight there (exact)
    active_tokens: int = 0  # their prompt tokens
    block_keys: Optional[Callable[[Sequence[int]], list[bytes]]] = None  # a prompt's block keys as its engines name them
    key_scheme: Any = None  # endpoints with equal schemes name a prompt's blocks alike (computed once per request)
    # vLLM's `vllm:cache_config_info` (block_size, num_gpu_blocks summed over the instance's DP ranks): what an
    # auto-tuned approximate prefix index reads (0: unknown)
    block_size: int = 0
    num_gpu_blocks: int = 0


@dataclass(slots=True)
class RouteDecision:
    pick: int
    scores: Optional[list[float]] = None  # per endpoint (None: the router does not score)
    candidates: Optional[list[int]] = None  # the endpoints left by the filters (None: all)


class Router(Protocol):
    def route(self, request: Any, endpoints: Sequence[Endpoint]) -> RouteDecision: ...


def reads_scraped_metrics(plugin: Any) -> bool:
    """Whether a router, scorer or filter reads the endpoints' scraped metrics (`waiting`, `running`,
    `kv_usage`): its `reads_metrics`; a plugin that does not say (a user's) is taken to read them. (speed: a
    cluster whose router reads none runs no scrapes, `servetwin.sim.cluster`; the scrapes change nothing else)"""
    return bool(getattr(plugin, "reads_metrics", True))


class RoundRobin:
    reads_metrics: ClassVar[bool] = False  # (`reads_scraped_metrics`)
    def __init__(self) -> None:
        self.next = 0

    def route(self, request: Any, endpoints: Sequence[Endpoint]) -> RouteDecision:
        pick = self.next % len(endpoints)
        self.next += 1
        return RouteDecision(pick)

    def forced_pick(self, request: Any, endpoints: Sequence[Endpoint]) -> Optional[int]:
        """The pick `route` makes next whatever the engines did (`LlmdRouter.forced_pick`): always known."""
        return self.next % len(endpoints)


class RandomRouter:
    reads_metrics: ClassVar[bool] = False  # (`reads_scraped_metrics`)
    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self._drawn: Optional[int] = None  # the next pick, drawn early by `forced_pick`

    def route(self, request: Any, endpoints: Sequence[Endpoint]) -> RouteDecision:
        pick, self._drawn = self._drawn, None
        return RouteDecision(int(self.rng.integers(len(endpoints))) if pick is None else pick)

    def forced_pick(self, request: Any, endpoints: Sequence[Endpoint]) -> Optional[int]:
        """The pick `route` makes next whatever the engines did (`LlmdRouter.forced_pick`): its draw, made here once
        and kept for `route` (the same draws in the same order as without this call)."""
        if self._drawn is None:
            self._drawn = int(self.rng.integers(len(endpoints)))
        return self._drawn


class LeastLoaded:
    """The endpoint with the fewest of the router's requests in flight (the first of equals)."""
    reads_metrics: ClassVar[bool] = False  # (`reads_scraped_metrics`)

    def route(self, request: Any, endpoints: Sequence[Endpoint]) -> RouteDecision:
        loads = [float(e.active) for e in endpoints]
        return RouteDecision(loads.index(min(loads)), loads)


# -- llm-d scorers -------------------------------------------------------------------------------
class Scorer(Protocol):
    def score(self, request: Any, endpoints: Sequence[Endpoint]) -> list[float]: ...


def queue_scores(endpoints: Sequence[Endpoint]) -> list[float]:
    qs = [e.waiting for e in endpoints]
    lo, hi = min(qs), max(qs)
    if hi == lo:
        return [1.0] * len(qs)
    return [(hi - q) / (hi - lo) for q in qs]


class QueueScorer:
    reads_metrics: ClassVar[bool] = True  # the scraped metrics (`reads_scraped_metrics`)
    def score(self, request: Any, endpoints: Sequence[Endpoint]) -> list[float]:
        return queue_scores(endpoints)


class KVCacheUtilizationScorer:
    reads_metrics: ClassVar[bool] = True  # the scraped metrics (`reads_scraped_metrics`)
    def score(self, request: Any, endpoints: Sequence[Endpoint]) -> list[float]:
        return [1.0 - e.kv_usage for e in endpoints]


@dataclass(slots=True)
class LoadAwareScorer:
    reads_metrics: ClassVar[bool] = True  # the scraped metrics (`reads_scraped_metrics`)
    threshold: int = LOAD_AWARE_THRESHOLD

    def score(self, request: Any, endpoints: Sequence[Endpoint]) -> list[float]:
        t = self.threshold
        return [0.5 if e.waiting == 0 else 0.5 * (1.0 - min(e.waiting, t) / t) for e in endpoints]


class ActiveRequestScorer:
    reads_metrics: ClassVar[bool] = False  # (`reads_scraped_metrics`)
    def score(self, request: Any, endpoints: Sequence[Endpoint]) -> list[float]:
        top = max(e.active for e in endpoints)
        if top == 0:
            return [1.0] * len(endpoints)
        return [(top - e.active) / top for e in endpoints]


@dataclass(slots=True)
class TokenLoadScorer:
    """`1 - min(t, T) / T`. Without an in-flight load producer t is the router's in-flight prompt tokens; with
    one (`InFlightLoad`, wired by `make_llm_d`) t is the endpoint's producer count plus what this request would
    add there (llm-d-router `scorer/tokenload/token_load.go:92-130` at 7f6c33663: `InFlightLoad.Tokens` +
    `UncachedRequestTokens.Tokens`)."""
    reads_metrics: ClassVar[bool] = False  # (`reads_scraped_metrics`)
    threshold: int = TOKEN_LOAD_THRESHOLD
    load: Optional["InFlightLoad"] = None

    def score(self, request: Any, endpoints: Sequence[Endpoint]) -> list[float]:
        t = self.threshold
        if self.load is None:
            return [1.0 if e.active_tokens <= 0 else 1.0 - min(e.active_tokens, t) / t for e in endpoints]
        out = []
        for e in endpoints:
            tokens = self.load.tokens_at(e.index) + self.load.request_tokens(request, e.index)
            out.append(1.0 if tokens <= 0 else 1.0 - min(tokens, t) / t)
        return out


def prompt_block_keys(tokens: Sequence[int], block_tokens: int, max_blocks: int,
                      tail_block: bool = False) -> list[int]:
    """Chained keys of the prompt's full blocks (a block's key covers every token before it); with
    `tail_block`, the last partial block too (llm-d-router's `getKVCacheBlocksFromTokens`, hashing.go:119 at
    7f6c33663, yields it), at most `max_blocks` in all."""
    full = len(tokens) // block_tokens
    n = max(0, min(full, max_blocks))
    keys: list[int] = []
    append, parent = keys.append, 0
    # (speed: zip over one iterator repeated makes the blocks' tuples in C, ~20% faster than a slice and a
    # tuple per block; every route hashes up to 256 blocks)
    for block in zip(*[iter(tokens[:n * block_tokens])] * block_tokens):
        parent = hash((parent, block))
        append(parent)
    if tail_block and n == full < max_blocks and len(tokens) > full * block_tokens:
        append(hash((parent, tuple(tokens[full * block_tokens:]))))
    return keys


@dataclass(slots=True)
class ApproxPrefixIndex:
    """The router's approximate prefix index (llm-d-router `approximateprefix/indexer.go` at 7f6c33663, as GIE's
    prefix plugin before it): per endpoint an LRU of the block keys of prompts routed there, and per key the
    endpoints holding it; it never sees the engines' evictions."""
    capacity: int = PREFIX_LRU_BLOCKS
    lru: dict[int, OrderedDict] = field(default_factory=dict)
    holders: dict[int, set[int]] = field(default_factory=dict)  # key -> the endpoints whose LRU holds it
    capacities: dict[int, int] = field(default_factory=dict)  # per endpoint, where it differs (auto-tune)
    version: int = 0  # counts the adds (what a scorer's kept matches were read at)

    def matches(self, keys: Sequence[int]) -> dict[int, int]:
        """llm-d's `matchLongestPrefix` (plugin.go:265): walk the keys from the first while some endpoint holds
        the key, counting for each endpoint the walked keys it holds."""
        out: dict[int, int] = {}
        holders = self.holders
        # (speed: consecutive keys are mostly held by the same endpoints - a prompt's blocks were routed
        # together - so the walk counts runs of equal holder sets, one set comparison a key, and adds each
        # run's length once per endpoint; the same counts, inserted in the same order: first seen first)
        run_set: Optional[set[int]] = None
        run = 0
        for k in keys:
            held = holders.get(k)
            if not held:
                break
            if held == run_set:
                run += 1
                continue
            if run_set is not None:
                for e in run_set:
                    out[e] = out.get(e, 0) + run
            run_set, run = held, 1
        if run_set is not None:
            for e in run_set:
                out[e] = out.get(e, 0) + run
        return out

    def add(self, endpoint: int, keys: Sequence[int]) -> None:
        self.version += 1
        table = self.lru.get(endpoint)
        if table is None:
            table = self.lru[endpoint] = OrderedDict()
        move_to_end, holders = table.move_to_end, self.holders
        for k in keys:  # (speed: one dict operation a key, not an assignment and a move: ~1/3 less)
            if k in table:
                move_to_end(k)
            else:
                table[k] = None  # (a new key goes to the end)
                held = holders.get(k)
                if held is None:
                    holders[k] = {endpoint}
                else:
                    held.add(endpoint)
        capacity = self.capacities.get(endpoint, self.capacity)
        while len(table) > capacity:  # (the eviction callback: the key leaves this endpoint's holders)
            k, _ = table.popitem(last=False)
            held = holders[k]
            held.discard(endpoint)
            if not held:
                del holders[k]


@dataclass(slots=True)
class PrefixCacheScorer:
    """The approximate prefix score: an endpoint's matched leading blocks / the prompt's blocks. Its defaults
    are GIE's prefix plugin's (16-token full blocks, at most 256); `approx_prefix_producer` builds llm-d-router's
    `approx-prefix-cache-producer` of 2026 with it (token cap, the partial last block, auto-tuning)."""
    reads_metrics: ClassVar[bool] = False  # (`reads_scraped_metrics`)
    block_tokens: int = PREFIX_BLOCK_TOKENS
    max_blocks: int = PREFIX_MAX_BLOCKS
    # GIE `lruCapacityPerServer` (llm-d's CPU-tier guide gives a second prefix scorer the tier's block count)
    lru_capacity_per_server: int = PREFIX_LRU_BLOCKS
    max_prefix_tokens: int = 0  # `maxPrefixTokensToMatch`: > 0 caps the blocks at it // block size (over max_blocks)
    tail_block: bool = False  # hash the prompt's last partial block too
    # `autoTune`: the block size is the engines' (the first endpoint's `cache_config_info`) and each endpoint's
    # LRU holds its engines' KV blocks (plugin.go:255, :296)
    auto_tune: bool = False
    min_block_tokens: int = 0  # the floor of the block size, whatever its source (`minBlockSizeTokens`)
    index: Optional[ApproxPrefixIndex] = None
    _last: Optional[tuple[Any, list[int]]] = field(default=None, repr=False, compare=False)
    _last_matches: Optional[tuple[Any, int, dict[int, int]]] = field(default=None, repr=False, compare=False)
    _tuned: bool = field(default=False, repr=False, compare=False)
    # (speed: a workload sends each of its prompt lists again and again - the gpt-oss ladder 750 lists in 17,084
    # requests - and hashing a 6,500-token prompt is most of a route: the keys are kept per list object,
    # servetwin.core.prompt_memo)
    _by_prompt: PromptMemo = field(default_factory=PromptMemo, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.block_tokens <= 0 or self.max_blocks <= 0 or self.lru_capacity_per_server <= 0:
            raise TypeError("block_tokens, max_blocks and lru_capacity_per_server must be > 0, got "
                            f"{self.block_tokens}, {self.max_blocks}, {self.lru_capacity_per_server}")
        if self.max_prefix_tokens < 0:
            raise TypeError(f"max_prefix_tokens must be >= 0, got {self.max_prefix_tokens}")
        self.block_tokens = max(self.block_tokens, self.min_block_tokens)
        self._set_max_blocks()
        if self.index is None:
            self.index = ApproxPrefixIndex(self.lru_capacity_per_server)

    def _set_max_blocks(self) -> None:
        if self.max_prefix_tokens > 0:
            self.max_blocks = self.max_prefix_tokens // self.block_tokens

    def tune(self, endpoints: Sequence[Endpoint]) -> None:
        """With `auto_tune`, read the engines' block size and KV blocks once (the router calls this first)."""
        if self._tuned or not self.auto_tune or not endpoints:
            return
        self._tuned = True
        self._last = self._last_matches = None  # (keys of the old block size)
        self._by_prompt.clear()
        if endpoints[0].block_size > 0:
            self.block_tokens = max(endpoints[0].block_size, self.min_block_tokens)
            self._set_max_blocks()
        self.index.capacities.update({e.index: e.num_gpu_blocks for e in endpoints if e.num_gpu_blocks > 0})

    def keys(self, request: Any) -> list[int]:
        """(Kept for the request last asked about: the filter, the score and the routed hook ask in turn.)"""
        if self._last is not None and self._last[0] is request:
            return self._last[1]
        tokens = request.prompt_token_ids
        keys = self._by_prompt.get(tokens)
        if keys is None:
            keys = prompt_block_keys(tokens, self.block_tokens, self.max_blocks, self.tail_block)
            self._by_prompt.put(tokens, keys)
        self._last = (request, keys)
        return keys

    def matches(self, request: Any) -> dict[int, int]:
        """Each endpoint's matched leading blocks of the request's prompt (kept until the index changes)."""
        last, version = self._last_matches, self.index.version
        if last is not None and last[0] is request and last[1] == version:
            return last[2]
        out = self.index.matches(self.keys(request))
        self._last_matches = (request, version, out)
        return out

    def uncached_tokens(self, request: Any, endpoint: int) -> int:
        """llm-d-router's `uncachedInputTokens` (inflightload/producer.go:521): the indexed blocks not matched,
        times the block size, plus the prompt's tokens beyond the indexed ones."""
        n = len(request.prompt_token_ids)
        total = len(self.keys(request))
        indexed = total * self.block_tokens
        return (total - self.matches(request).get(endpoint, 0)) * self.block_tokens + max(0, n - indexed)

    def score(self, request: Any, endpoints: Sequence[Endpoint]) -> list[float]:
        keys = self.keys(request)
        if not keys:
            return [0.0] * len(endpoints)
        matches, n = self.matches(request), len(keys)
        return [matches.get(e.index, 0) / n for e in endpoints]

    def on_routed(self, request: Any, endpoint: Endpoint) -> None:
        self.index.add(endpoint.index, self.keys(request))


def approx_prefix_producer(**params: Any) -> PrefixCacheScorer:
    """llm-d-router's `approx-prefix-cache-producer` with its defaults at 7f6c33663 (`defaultConfig`,
    types.go:146): `autoTune` on, `blockSizeTokens` 16 floored at 64 (the engines' block size when tuned),
    `maxPrefixTokensToMatch` 131,072, the prompt's partial last block hashed, `lruCapacityPerServer` 31,250
    (each endpoint's KV blocks when tuned). `params` override: block_tokens, max_prefix_tokens, max_blocks,
    lru_capacity_per_server, auto_tune."""
    unknown = sorted(set(params) - {"block_tokens", "max_prefix_tokens", "max_blocks", "lru_capacity_per_server",
                                    "auto_tune"})
    if unknown:
        raise TypeError(f"unknown parameter {unknown[0]!r}; known: auto_tune, block_tokens, lru_capacity_per_server, "
                        "max_blocks, max_prefix_tokens")
    cfg = {"block_tokens": PREFIX_BLOCK_TOKENS, "max_prefix_tokens": PRODUCER_MAX_PREFIX_TOKENS, "auto_tune": True,
           **params}
    return PrefixCacheScorer(tail_block=True, min_block_tokens=PRODUCER_MIN_BLOCK_TOKENS, **cfg)


IN_FLIGHT_OUTPUT_RATIO = 1.5  # llm-d-router inflightload/token_estimator.go:39 DefaultOutputRatio


@dataclass(slots=True)
class InFlightLoad:
    """llm-d's `inflight-load-producer` (llm-d-router `pkg/epp/framework/plugins/requestcontrol/dataproducer/
    inflightload/producer.go` at 7f6c33663, 2026-06-26, the router of the llm-d guides' runs of June-July 2026):
    per endpoint, the requests routed there and not finished, and the tokens they still cost it. At routing a
    request is charged its prompt tokens not matched in that endpoint's approximate prefix index (`PreRequest`,
    :337, `uncachedInputTokens`, :521: the index's unmatched blocks plus the prompt's tail beyond them), plus,
    with `add_estimated_output_tokens`, round(prompt x `output_ratio`) bounded by its `max_tokens`
    (`estimateRequestTokens`, :393; `token_estimator.go:100`). Its tokens are released at its first streamed
    token when no output is estimated (`ResponseBody`, :427, the default since #1029 of May 2026: "prefill is
    done"), else when it finishes (:456), which also releases its request count. The cluster calls
    `on_first_token` and `on_finished` (see `LlmdRouter.wants_first_token`)."""
    prefix: Optional[PrefixCacheScorer] = None  # the approximate index it discounts against (None: no discount)
    add_estimated_output_tokens: bool = False  # `addEstimatedOutputTokens`, default false (producer.go:68)
    output_ratio: float = IN_FLIGHT_OUTPUT_RATIO
    tokens: dict[int, int] = field(default_factory=dict)  # endpoint -> tokens charged
    requests: dict[int, int] = field(default_factory=dict)  # endpoint -> requests in flight
    charged: dict[Any, tuple[int, int]] = field(default_factory=dict)  # request id -> (endpoint, its tokens)
    # a partitioned cluster run (sim/cluster_parallel.py): each endpoint's tokens at the workers' last meeting plus
    # every charge since - an upper bound of `tokens` that every worker's replica of the router shares (the
    # releases since are another worker's news); None: no meeting yet
    meeting_tokens: Optional[dict[int, int]] = None

    def __post_init__(self) -> None:
        if self.output_ratio < 0:
            raise TypeError(f"output_ratio must be >= 0, got {self.output_ratio}")

    def tokens_at(self, endpoint: int) -> int:
        return self.tokens.get(endpoint, 0)

    def uncached_tokens(self, request: Any, endpoint: int) -> int:
        """The prompt tokens the endpoint's approximate index does not hold (`uncachedInputTokens`)."""
        if self.prefix is None:
            return len(request.prompt_token_ids)
        return self.prefix.uncached_tokens(request, endpoint)

    def request_tokens(self, request: Any, endpoint: int) -> int:
        """What routing `request` to `endpoint` would add to its count (`UncachedRequestTokens`)."""
        tokens = self.uncached_tokens(request, endpoint)
        if self.add_estimated_output_tokens:
            n = len(request.prompt_token_ids)
            tokens += min(int(round(n * self.output_ratio)), max(0, int(request.max_tokens))) if n else 0
        return tokens

    def on_routed(self, request: Any, endpoint: int) -> None:
        """Charge the request (before the prefix index learns its prompt: the charge is the pre-routing match)."""
        tokens = self.request_tokens(request, endpoint)
        self.tokens[endpoint] = self.tokens.get(endpoint, 0) + tokens
        self.requests[endpoint] = self.requests.get(endpoint, 0) + 1
        self.charged[request.request_id] = (endpoint, tokens)
        if self.meeting_tokens is not None:
            self.meeting_tokens[endpoint] = self.meeting_tokens.get(endpoint, 0) + tokens

    def mark_meeting(self) -> None:
        """The workers of a partitioned run met: every release up to now is known (`meeting_tokens`)."""
        self.meeting_tokens = dict(self.tokens)

    def _release_tokens(self, request_id: Any) -> None:
        entry = self.charged.get(request_id)
        if entry is not None and entry[1]:
            self.tokens[entry[0]] -= entry[1]
            self.charged[request_id] = (entry[0], 0)

    def on_first_token(self, request_id: Any) -> None:
        if not self.add_estimated_output_tokens:
            self._release_tokens(request_id)

    def on_finished(self, request_id: Any) -> None:
        self._release_tokens(request_id)
        entry = self.charged.pop(request_id, None)
        if entry is not None:
            self.requests[entry[0]] -= 1


@dataclass(slots=True)
class PrecisePrefixCacheScorer:
    """An index per endpoint of the blocks its engines reported cached (KV events: stored adds, removed and
    cleared drop, as llm-d's kv-cache indexer keeps a key -> pods map), `event_delay_s` behind the engines."""
    reads_metrics: ClassVar[bool] = False  # (`reads_scraped_metrics`)
    max_blocks: int = PREFIX_MAX_BLOCKS
    event_delay_s: float = KV_EVENT_DELAY_S
    index: dict[int, set] = field(default_factory=dict)
    wants_kv_events: bool = True

    def on_kv_events(self, endpoint: int, events: Sequence[tuple[str, Any]]) -> None:
        keys = self.index.setdefault(endpoint, set())
        for kind, key in events:
            if kind == "stored":
                keys.add(key)
            elif kind == "removed":
                keys.discard(key)
            else:
                keys.clear()

    def endpoint_keys(self, request: Any, endpoints: Sequence[Endpoint]) -> list[list[bytes]]:
        """Each endpoint's keys of the prompt's leading blocks (computed once per key scheme)."""
        tokens = request.prompt_token_ids
        out = []
        by_scheme: dict[Any, list] = {}
        for e in endpoints:
            keys = by_scheme.get(e.key_scheme) if e.key_scheme is not None else None
            if keys is None:
                keys = e.block_keys(tokens)[:self.max_blocks] if e.block_keys is not None else []
                if e.key_scheme is not None:
                    by_scheme[e.key_scheme] = keys
            out.append(keys)
        return out

    def score(self, request: Any, endpoints: Sequence[Endpoint]) -> list[float]:
        out = []
        for e, keys in zip(endpoints, self.endpoint_keys(request, endpoints)):
            held = self.index.get(e.index, ())
            hit = 0
            for k in keys:
                if k not in held:
                    break
                hit += 1
            out.append(hit / len(keys) if keys else 0.0)
        return out


@dataclass(slots=True)
class TieredPrefixCacheScorer(PrecisePrefixCacheScorer):
    """The precise scorer over both tiers of an instance: the GPU prefix cache and the CPU offload tier (llm-d's
    precise indexer keeps each block's pods and device tier; vLLM 0.33's OffloadingConnector publishes its CPU
    tier's BlockStored / BlockRemoved with medium "CPU" in the same stream, offloading_connector.py:231-233).
    Walk the prompt's leading blocks while the endpoint holds each in either tier: a GPU block counts
    `gpu_weight`, a block only in the CPU tier `cpu_weight`; score = the sum / prompt blocks."""
    gpu_weight: float = 1.0
    cpu_weight: float = 1.0
    cpu_index: dict[int, set] = field(default_factory=dict)
    wants_cpu_kv_events: bool = True

    def on_cpu_kv_events(self, endpoint: int, events: Sequence[tuple[str, Any]]) -> None:
        """("stored" | "removed", block hash) of the endpoint's CPU tier. The tier keys a chunk by its block's
        hash, the GPU index by (hash, KV cache group): a CPU tier holds full-attention group 0."""
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


SCORERS: dict[str, Callable[..., Any]] = {
    "queue": QueueScorer, "kv-cache-utilization": KVCacheUtilizationScorer, "load-aware": LoadAwareScorer,
    "active-request": ActiveRequestScorer, "token-load": TokenLoadScorer, "prefix-cache": PrefixCacheScorer,
    "precise-prefix-cache": PrecisePrefixCacheScorer, "tiered-prefix-cache": TieredPrefixCacheScorer,
}


@dataclass(slots=True)
class PrefixAffinityFilter:
    """llm-d's `prefix-cache-affinity-filter` (llm-d-router `pkg/epp/framework/plugins/scheduling/filter/
    prefixcacheaffinity/plugin.go`, `Filter`): the "sticky" endpoints are those whose approximate prefix score
    is at least `threshold` (`affinityThreshold`, default 0.80); with none, every endpoint stays. The TTFT load
    gate breaks stickiness (every endpoint stays) when the best sticky endpoint's estimated TTFT exceeds the
    best non-sticky one's by more than `max_ttft_penalty_ms` (`maxTTFTPenaltyMs`, default 18,000; 0 turns the
    gate off), the estimate being the endpoint's in-flight tokens / `peak_prefill_throughput`
    (`peakPrefillThroughput`, tokens/s, default 15,928: its Qwen3-32B TP2 H100 calibration): the in-flight load
    producer's count when the router has one (`InFlightLoad`, as the plugin reads `InFlightLoad.Tokens`), else
    the router's in-flight prompt tokens."""
    reads_metrics: ClassVar[bool] = False  # (`reads_scraped_metrics`)
    scorer: PrefixCacheScorer
    threshold: float = 0.80
    max_ttft_penalty_ms: float = 18_000.0
    peak_prefill_throughput: float = 15_928.0
    load: Optional[InFlightLoad] = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise TypeError(f"threshold must be in [0, 1], got {self.threshold}")
        if self.max_ttft_penalty_ms < 0 or self.peak_prefill_throughput <= 0:
            raise TypeError("max_ttft_penalty_ms must be >= 0 and peak_prefill_throughput > 0")

    def estimated_ttft_ms(self, endpoint: Endpoint) -> float:
        tokens = endpoint.active_tokens if self.load is None else self.load.tokens_at(endpoint.index)
        return tokens / self.peak_prefill_throughput * 1000.0

    def _sticky(self, request: Any, endpoints: Sequence[Endpoint]) -> Optional[tuple[list[int], list[int]]]:
        """(the sticky endpoints, the others), or None when every endpoint stays whatever the loads."""
        if len(endpoints) <= 1 or self.threshold <= 0:
            return None
        scores = self.scorer.score(request, endpoints)
        sticky = [i for i, s in enumerate(scores) if s >= self.threshold]
        if not sticky:
            return None
        return sticky, [i for i, s in enumerate(scores) if s < self.threshold]

    def forced_filter(self, request: Any, endpoints: Sequence[Endpoint]) -> Optional[list[int]]:
        """What `filter` keeps whatever in-flight tokens were released since the workers' last meeting (their
        releases only lower the estimates, `InFlightLoad.meeting_tokens` bounds them from above); None: it may
        depend on them (the TTFT gate might open)."""
        split = self._sticky(request, endpoints)
        if split is None:
            return list(range(len(endpoints)))
        sticky, others = split
        if self.max_ttft_penalty_ms > 0 and others:
            bound = None if self.load is None else self.load.meeting_tokens
            if bound is None:
                return None
            # (the penalty is the sticky endpoints' least estimate minus the others' least, which is >= 0)
            if min(bound.get(endpoints[i].index, 0) for i in sticky) / self.peak_prefill_throughput * 1000.0 \
                    > self.max_ttft_penalty_ms:
                return None
        return sticky

    def filter(self, request: Any, endpoints: Sequence[Endpoint]) -> list[int]:
        split = self._sticky(request, endpoints)
        if split is None:
            return list(range(len(endpoints)))
        sticky, others = split
        if self.max_ttft_penalty_ms > 0 and others:
            penalty = (min(self.estimated_ttft_ms(endpoints[i]) for i in sticky)
                       - min(self.estimated_ttft_ms(endpoints[i]) for i in others))
            if penalty > self.max_ttft_penalty_ms:
                return list(range(len(endpoints)))
        return sticky


class LlmdRouter:
    """Filters -> weighted scorers -> max-score picker, ties broken at random."""

    def __init__(self, scorers: Sequence[tuple[Any, float]], rng: np.random.Generator,
                 filters: Sequence[Any] = (), load: Optional[InFlightLoad] = None) -> None:
        self.scorers = list(scorers)
        self.filters = list(filters)
        self.rng = rng
        self.load = load  # llm-d's inflight-load-producer (None: the scorers read the router's own counts)
        # the approximate indexes that read the engines' block size and KV blocks at the first route
        plugins = [s for s, _ in self.scorers] + [getattr(f, "scorer", None) for f in self.filters]
        self._to_tune = [p for p in {id(p): p for p in plugins}.values() if getattr(p, "auto_tune", False)]

    @property
    def reads_metrics(self) -> bool:
        return any(reads_scraped_metrics(p) for p in [s for s, _ in self.scorers] + self.filters)

    def route(self, request: Any, endpoints: Sequence[Endpoint]) -> RouteDecision:
        if self._to_tune:
            for producer in self._to_tune:
                producer.tune(endpoints)
            self._to_tune = []
        candidates = list(range(len(endpoints)))
        for f in self.filters:
            kept = f.filter(request, [endpoints[i] for i in candidates])
            candidates = [candidates[i] for i in kept]
        views = [endpoints[i] for i in candidates]
        total = [0.0] * len(views)
        for scorer, weight in self.scorers:
            for i, s in enumerate(scorer.score(request, views)):
                total[i] += weight * s
        best = max(total)
        ties = [i for i, s in enumerate(total) if s == best]
        pick = ties[int(self.rng.integers(len(ties)))] if len(ties) > 1 else ties[0]
        scores = [float("nan")] * len(endpoints)
        for i, s in zip(candidates, total):
            scores[i] = s
        return RouteDecision(candidates[pick], scores, candidates if self.filters else None)

    def forced_pick(self, request: Any, endpoints: Sequence[Endpoint]) -> Optional[int]:
        """The pick `route` will make whatever the engines did that this replica of the router has not heard of
        (first tokens and ends release in-flight counts and charges; scrapes change the metrics), read only from
        what every replica shares: the filters' single candidate where each filter proves it (`forced_filter`).
        None: the pick may depend on that news (a partitioned cluster's workers meet first, sim/cluster_parallel.py)."""
        if self._to_tune:
            return None
        candidates = list(range(len(endpoints)))
        for f in self.filters:
            forced = getattr(f, "forced_filter", None)
            kept = forced(request, [endpoints[i] for i in candidates]) if forced is not None else None
            if kept is None:
                return None
            candidates = [candidates[i] for i in kept]
        return candidates[0] if len(candidates) == 1 else None

    def route_forced(self, request: Any, endpoints: Sequence[Endpoint], pick: int) -> RouteDecision:
        """`route`'s decision for a pick `forced_pick` proved, without its scores (a worker that does not own the
        endpoint: the owner's scores go to the decision table). The same state changes as `route`: none, with one
        candidate (no tie to draw for) and the producers tuned."""
        return RouteDecision(pick, None, [pick] if self.filters else None)

    def at_meeting(self) -> None:
        """A partitioned cluster's workers met (`forced_pick`'s bounds start again from the exact counts)."""
        if self.load is not None:
            self.load.mark_meeting()

    @property
    def wants_kv_events(self) -> bool:
        return any(getattr(s, "wants_kv_events", False) for s, _ in self.scorers)

    @property
    def kv_event_delay_s(self) -> float:
        return max((getattr(s, "event_delay_s", 0.0) for s, _ in self.scorers
                    if getattr(s, "wants_kv_events", False)), default=0.0)

    def on_kv_events(self, endpoint: int, events: Sequence[tuple[str, Any]]) -> None:
        for scorer, _ in self.scorers:
            if getattr(scorer, "wants_kv_events", False):
                scorer.on_kv_events(endpoint, events)

    @property
    def wants_cpu_kv_events(self) -> bool:
        return any(getattr(s, "wants_cpu_kv_events", False) for s, _ in self.scorers)

    def on_cpu_kv_events(self, endpoint: int, events: Sequence[tuple[str, Any]]) -> None:
        """A CPU tier's events (medium CPU: the offloading connector's, sim/cluster_offload.py)."""
        for scorer, _ in self.scorers:
            if getattr(scorer, "wants_cpu_kv_events", False):
                scorer.on_cpu_kv_events(endpoint, events)

    @property
    def wants_first_token(self) -> bool:
        """Whether the cluster must call `on_first_token` / `on_finished` per request (its producer's release)."""
        return self.load is not None

    def on_first_token(self, request_id: Any) -> None:
        if self.load is not None:
            self.load.on_first_token(request_id)

    def on_finished(self, request_id: Any) -> None:
        if self.load is not None:
            self.load.on_finished(request_id)

    def on_routed(self, request: Any, endpoint: Endpoint) -> None:
        if self.load is not None:  # first: its charge is the match before the index learns this prompt
            self.load.on_routed(request, endpoint.index)
        seen = set()
        for scorer in [s for s, _ in self.scorers] + [getattr(f, "scorer", None) for f in self.filters]:
            hook = getattr(scorer, "on_routed", None)
            if hook is not None and id(scorer) not in seen:
                seen.add(id(scorer))
                hook(request, endpoint)


# -- prefill/decode disaggregation: the decider hook (P/D itself is simulated later) --------------------------
@dataclass(slots=True)
class PrefixBasedPDDecider:
    """llm-d's `prefix-based-pd-decider`: a request is prefilled on a prefill instance only when the prompt
    tokens not already cached on the chosen decode instance exceed `non_cached_tokens` (16 by default,
    llm-d-inference-scheduler deploy/config/pd-epp-config.yaml `nonCachedTokens: 16`); otherwise the decode
    instance prefills it itself. `cached_tokens` comes from the router's prefix index for that instance."""
    non_cached_tokens: int = 16

    def disaggregate(self, num_prompt_tokens: int, cached_tokens: int) -> bool:
        return num_prompt_tokens - cached_tokens > self.non_cached_tokens


# -- building from the config ----------------------------------------------------------------------
def _plugin(group: str, name: str) -> Optional[Callable[..., Any]]:
    for ep in importlib.metadata.entry_points(group=group):
        if ep.name == name:
            return ep.load()
    return None


def build_scorer(name: str, params: Mapping[str, Any], path: str) -> Any:
    factory = SCORERS.get(name) or _plugin(SCORER_ENTRY_POINTS, name)
    if factory is None:
        raise ConfigError(f"{path}.type", f"unknown scorer {name!r}; built in: {', '.join(SCORERS)} "
                                          f"(others through the entry point group {SCORER_ENTRY_POINTS!r})")
    try:
        return factory(**params)
    except TypeError as e:
        raise ConfigError(path, f"bad parameters for scorer {name!r}: {e}") from None


# Router factories: `factory(spec, rng)` with spec a `servetwin.experiments.config.cluster.RouterConfig` and rng
# the router's own random stream; the same signature for the entry points of `servetwin.routers`.
def make_round_robin(spec: Any, rng: np.random.Generator) -> RoundRobin:
    return RoundRobin()


def make_random(spec: Any, rng: np.random.Generator) -> RandomRouter:
    return RandomRouter(rng)


def make_least_loaded(spec: Any, rng: np.random.Generator) -> LeastLoaded:
    return LeastLoaded()


ROUTER_PARAMS = ("approx_prefix", "in_flight_load")  # the llm_d router's `params`


def _router_param(params: Mapping[str, Any], name: str, build: Callable[..., Any], path: str) -> Any:
    """`params.<name>` built with its parameters ({} or null: the defaults); absent -> None."""
    unknown = sorted(set(params) - set(ROUTER_PARAMS))
    if unknown:
        raise ConfigError(f"{path}.params.{unknown[0]}", f"unknown llm_d router parameter; known: {', '.join(ROUTER_PARAMS)}")
    if name not in params:
        return None
    cfg = params[name] if params[name] is not None else {}
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"{path}.params.{name}", "expected a mapping (its parameters, or {})")
    try:
        return build(**cfg)
    except TypeError as e:
        raise ConfigError(f"{path}.params.{name}", f"bad parameters: {e}") from None


def make_llm_d(spec: Any, rng: np.random.Generator) -> LlmdRouter:
    path = getattr(spec, "path", "cluster.router")  # (P/D: cluster.prefill_router too)
    params = getattr(spec, "params", None) or {}
    # llm-d-router's inflight-load-producer (`InFlightLoad`) and approx-prefix-cache-producer: the one approximate
    # index the affinity filter, the in-flight load and every `prefix-cache` scorer read
    load: Optional[InFlightLoad] = _router_param(params, "in_flight_load", InFlightLoad, path)
    producer: Optional[PrefixCacheScorer] = _router_param(params, "approx_prefix", approx_prefix_producer, path)
    scorers = []
    for i, s in enumerate(spec.scorers):
        if producer is not None and s.type == "prefix-cache":  # (llm-d 2026: the scorer reads the producer)
            if s.params:
                raise ConfigError(f"{path}.scorers[{i}].params", "with params.approx_prefix the prefix-cache "
                                  "scorer reads that index: set its parameters there")
            scorers.append((producer, s.weight))
        else:
            scorers.append((build_scorer(s.type, s.params, f"{path}.scorers[{i}]"), s.weight))
    shared = producer or next((s for s, _ in scorers if isinstance(s, PrefixCacheScorer)), None)
    filters = []
    for i, f in enumerate(spec.filters):
        if f.type != "prefix-cache-affinity":
            raise ConfigError(f"{path}.filters[{i}].type",
                              f"unknown filter {f.type!r}; built in: prefix-cache-affinity")
        try:
            filters.append(PrefixAffinityFilter(shared or PrefixCacheScorer(), **f.params, load=load))
        except TypeError as e:
            raise ConfigError(f"{path}.filters[{i}]", f"bad parameters: {e}") from None
        shared = shared or filters[-1].scorer
    if load is not None:  # the producer discounts against the approximate index; the token scorers read it
        load.prefix = shared
        for scorer, _ in scorers:
            if isinstance(scorer, TokenLoadScorer):
                scorer.load = load
    return LlmdRouter(scorers, rng, filters, load)


ROUTERS: dict[str, Callable[[Any, np.random.Generator], Any]] = {
    "round_robin": make_round_robin, "random": make_random, "least_loaded": make_least_loaded, "llm_d": make_llm_d,
}


def build_router(spec: Any, rng: np.random.Generator) -> Any:
    """The router of a `RouterConfig`: a built-in one, else the entry point of that name."""
    factory = ROUTERS.get(spec.type) or _plugin(ROUTER_ENTRY_POINTS, spec.type)
    if factory is None:
        raise ConfigError(f"{getattr(spec, 'path', 'cluster.router')}.type",
                          f"unknown router {spec.type!r}; built in: {', '.join(ROUTERS)} "
                          f"(others through the entry point group {ROUTER_ENTRY_POINTS!r})")
    return factory(spec, rng)


__all__ = ["ROUTERS", "Endpoint", "RouteDecision", "Router", "RoundRobin", "RandomRouter", "LeastLoaded", "LlmdRouter",
           "SCORERS", "build_router", "build_scorer", "queue_scores", "prompt_block_keys", "ApproxPrefixIndex",
           "PrefixCacheScorer", "PrecisePrefixCacheScorer", "PrefixAffinityFilter", "PrefixBasedPDDecider",
           "TieredPrefixCacheScorer", "InFlightLoad", "approx_prefix_producer",
           "DEFAULT_SCRAPE_INTERVAL_S"]
