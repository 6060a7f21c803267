"""Synthetic and trace-driven workloads: the requests a simulation (or a real run) serves.

A workload config (all fields optional except where noted):

    workload:
      seed: 0
      requests: 1000            # required unless prefix groups or a trace fix it
      vocab_size: 32000             # defaults to the model's vocabulary when built for a model
      prompt_tokens: {type: lognormal, mean: 512, cv: 1.0}   # see servetwin.sim.lengths
      output_tokens: 128
      max_prompt_tokens: 8192       # caps (clip) on the drawn lengths
      max_output_tokens: 2048
      n: 1                          # parallel sampling
      priority: 0                   # or a list of priorities drawn uniformly
      finish: max_tokens            # or "eos": max_tokens = max_output_tokens, EOS forced at the
                                    #   drawn output length (WorkloadRequest.eos_at)
      timeout_s: 30                 # optional: the client aborts a request not finished 30 s after
                                    #   its arrival (vLLM: finish_requests(FINISHED_ABORTED) between steps)
      shared_prefix:                # shared-prefix groups; replaces prompt_tokens
        groups: 256
        per_group: 4
        prefix_tokens: 8192
        suffix_tokens: 200             # length distribution, 0 allowed
        order: grouped              # grouped | interleaved | shuffled | inference_perf (shuffled once,
                                    #   every `stages` arrival stage resends the list from its start)
        repeat: 1                   # the pattern (groups x per_group in `order`) this many times over, one
                                    #   after the other, each time with groups of its own: the same traffic,
                                    #   longer (`servetwin capacity` extends a probe this way)
      lengths:                      # joint (prompt, output) pairs under vLLM's ShareGPT limits;
        type: sharegpt_like         #   replaces prompt_tokens / output_tokens (servetwin.sim.length_pairs)
        prompt: {type: lognormal, mean: 300, cv: 1.2}
        output: {type: lognormal, mean: 250, cv: 1.0}
      conversations: {...}          # multi-turn chats, see servetwin.sim.conversation; replaces
                                    #   requests / prompt_tokens / output_tokens (arrival: their starts)
      arrival: {type: poisson, rate: 4.0}   # see servetwin.sim.arrivals
      file: trace.jsonl             # the requests' lengths (and, without `arrival`, their times) from a
                                    #   trace; `arrival: {type: trace, path: ...}` is the same without `file`

Determinism: one `numpy.random.SeedSequence(seed)` is split into independent streams for tokens,
lengths, arrivals, order and priorities, so changing the arrival process does not change prompts (conversations add a `think` stream).
Prompts are token ids: a group's prefix is the same list for all its members (equal block hashes),
and different groups differ from their first token.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from servetwin.core.config_error import ConfigError
from servetwin.sim.arrivals import ArrivalProcess, Offline, StageLadder, TraceArrivals, parse_arrival
from servetwin.sim.conversation import (ANSWER_PLACEHOLDER, ConversationArrivals, ConversationsSpec, ConversationTurn,
                                        check_start_process, parse_conversations, think_times)
from servetwin.sim.length_pairs import JointLengths, parse_joint_lengths
from servetwin.sim.lengths import Fixed, LengthDist, parse_length_dist
from servetwin.sim.trace_file import TraceRecord, load_trace
from servetwin.core.sampling_params import MAX_N_SEQUENCES
from servetwin.sim.validate import as_int, check_keys, check_mapping, int_at_least, one_of, positive

_TOKEN_OBJECTS: dict[int, np.ndarray] = {}  # vocab size -> object array of the ints 0 .. vocab - 1


def draw_tokens(gen: np.random.Generator, vocab_size: int, size: int) -> list[int]:
    """`gen.integers(0, vocab_size, size).tolist()` whose ints are shared objects, one per token id:
    8 bytes a prompt token instead of 36 (a fresh int object each), so 100k prompts stay in memory
    (the draw, and so the workload, is the same)."""
    table = _TOKEN_OBJECTS.get(vocab_size)
    if table is None:
        table = _TOKEN_OBJECTS[vocab_size] = np.array(range(vocab_size), dtype=object)
    return table[gen.integers(0, vocab_size, size=size)].tolist()


def draw_token_lists(gen: np.random.Generator, vocab_size: int, sizes: Sequence[int],
                     chunk_tokens: int = 1 << 20) -> list[list[int]]:
    """`[draw_tokens(gen, vocab_size, k) for k in sizes]` from one generator call per ~`chunk_tokens` tokens
    (speed: not one call per prompt; memory: the transient arrays stay ~3 x 8 bytes x `chunk_tokens`). The
    same values and generator state after: `integers` draws value by value from the bit generator, so
    consecutive draws concatenate (tests/sim/test_sim_workload.py checks it)."""
    sizes = [int(k) for k in sizes]
    out: list[list[int]] = []
    i = 0
    while i < len(sizes):
        j, total = i, 0
        while j < len(sizes) and (j == i or total + sizes[j] <= chunk_tokens):
            total += sizes[j]
            j += 1
        flat = draw_tokens(gen, vocab_size, total)
        start = 0
        for k in sizes[i:j]:
            out.append(flat[start:start + k])
            start += k
        i = j
    return out


# Bounds that turn an impossible run into a named error instead of a huge allocation: every request
# and its prompt token ids are built before the run (10M requests, 200M prompt tokens: a few GiB).
MAX_REQUESTS = 10_000_000
MAX_PROMPT_TOKENS = 200_000_000
# What a run holds per request and per token (measured, benchmarks/large_inputs.py and docs/limits.md:
# 1M requests of 8 + 4 tokens peaked at 2.5 GB, 2,000 of 10,000 + 2 at 650 MB), and the budget a run's
# estimate must stay under before anything is built; SERVETWIN_MAX_RUN_MEMORY_MB raises it.
RUN_BYTES_PER_REQUEST = 2_400
RUN_BYTES_PER_TOKEN = 24
RUN_BASE_BYTES = 200 << 20
DEFAULT_MAX_RUN_MEMORY_MB = 2048


def check_run_memory(requests: int, prompt_tokens: int, output_tokens: int, path: str) -> None:
    """A `ConfigError` at `path` when a run of this size would need more memory than the budget (every
    request, its prompt and its output tokens are held until the run ends)."""
    raw = os.environ.get("SERVETWIN_MAX_RUN_MEMORY_MB", "")
    try:
        budget_mb = int(raw) if raw.strip() else DEFAULT_MAX_RUN_MEMORY_MB
    except ValueError:
        raise ConfigError("SERVETWIN_MAX_RUN_MEMORY_MB", f"must be an integer (MB), got {raw!r}") from None
    need = RUN_BASE_BYTES + RUN_BYTES_PER_REQUEST * requests + RUN_BYTES_PER_TOKEN * (prompt_tokens + output_tokens)
    if need > budget_mb << 20:
        raise ConfigError(path, f"{requests:,} requests of {prompt_tokens:,} prompt and {output_tokens:,} output "
                                f"tokens would need about {need >> 20:,} MB, more than the run memory limit of "
                                f"{budget_mb:,} MB (lower workload.requests or the lengths; "
                                "SERVETWIN_MAX_RUN_MEMORY_MB=N raises the limit)")

# appended streams leave the others unchanged (SeedSequence children are keyed by their index)
_STREAMS = ("tokens", "lengths", "arrivals", "order", "priority", "runtime", "think")


@dataclass(slots=True)
class WorkloadRequest:
    request_id: str
    arrival_s: float
    prompt_token_ids: list[int]
    max_tokens: int
    n: int = 1
    priority: int = 0
    group: Optional[int] = None
    eos_at: Optional[int] = None  # force EOS as this output token (None: finish by max_tokens)
    timeout_s: Optional[float] = None  # the client aborts the request this long after its arrival
    conversation: Optional[ConversationTurn] = None  # a turn of a multi-turn conversation
    # the Simulation stores the finished request's output token ids in `output_token_ids` (n = 1;
    # a conversation's next turn holds them in its prompt)
    keep_output_tokens: bool = False
    output_token_ids: Optional[list[int]] = None
    # vLLM's per-request KV connector parameters (extra_args["kv_transfer_params"]), e.g. a decode
    # engine's {"do_remote_prefill": True, "remote_block_ids": ..., ...}; each child gets a copy
    kv_transfer_params: Optional[dict[str, Any]] = None


@dataclass(slots=True, frozen=True)
class PrefixGroups:
    groups: int
    per_group: int
    prefix_tokens: int
    suffix_tokens: LengthDist
    order: str = "grouped"  # grouped | interleaved | shuffled
    repeat: int = 1  # the groups x per_group pattern, this many times in a row (each time new groups)


@dataclass(slots=True)
class WorkloadSpec:
    requests: Optional[int] = None
    prompt_tokens: LengthDist = field(default_factory=lambda: Fixed(128))
    output_tokens: LengthDist = field(default_factory=lambda: Fixed(128))
    shared_prefix: Optional[PrefixGroups] = None
    lengths: Optional[JointLengths] = None  # joint (prompt, output) pairs; replaces the two dists
    conversations: Optional[ConversationsSpec] = None
    n: int = 1
    priority: tuple[int, ...] = (0,)
    max_prompt_tokens: Optional[int] = None
    max_output_tokens: Optional[int] = None
    finish: str = "max_tokens"
    timeout_s: Optional[float] = None
    vocab_size: Optional[int] = None  # None: the model's vocabulary (given to `generate_requests`)
    seed: int = 0
    arrival: ArrivalProcess = field(default_factory=Offline)
    trace: Optional[TraceArrivals] = None  # the trace whose records give the requests' lengths
    path: str = "workload"  # where the section sits in its config (for errors found when generating)
    trace_field: str = ""  # the field that names the trace file

    @classmethod
    def from_dict(cls, cfg: Any, path: str = "workload",
                  vocab_size: Optional[int] = None) -> "WorkloadSpec":
        cfg = check_mapping(cfg, path)
        check_keys(cfg, {"seed", "requests", "vocab_size", "prompt_tokens", "output_tokens",
                         "max_prompt_tokens", "max_output_tokens", "n", "priority", "finish",
                         "shared_prefix", "arrival", "file", "timeout_s", "lengths", "conversations"}, path)
        spec = cls(path=path)
        spec.seed = int_at_least(cfg.get("seed", 0), 0, f"{path}.seed")
        vocab = cfg.get("vocab_size", vocab_size)
        spec.vocab_size = None if vocab is None else int_at_least(vocab, 2, f"{path}.vocab_size")
        # a trace keeps only the `requests` earliest records (a 10M-line file for a 1000-request run)
        limit = cfg.get("requests") if isinstance(cfg.get("requests"), int) and cfg["requests"] >= 1 else None
        spec.arrival = parse_arrival(cfg.get("arrival"), f"{path}.arrival", trace_limit=limit)
        if "file" in cfg:  # lengths from the file; its times unless an arrival process is given
            spec.trace = TraceArrivals(str(cfg["file"]), tuple(load_trace(cfg["file"], f"{path}.file",
                                                                          limit=limit)))
            spec.trace_field = f"{path}.file"
            if "arrival" not in cfg:
                spec.arrival = spec.trace
        elif isinstance(spec.arrival, TraceArrivals):
            spec.trace, spec.trace_field = spec.arrival, f"{path}.arrival.path"
        is_trace = spec.trace is not None
        source = f"{path}.file" if "file" in cfg else "a trace arrival"
        if "requests" in cfg:
            spec.requests = int_at_least(cfg["requests"], 1, f"{path}.requests")
            if spec.requests > MAX_REQUESTS:
                raise ConfigError(f"{path}.requests", f"at most {MAX_REQUESTS:,} requests per run (every request "
                                  f"and its prompt are held in memory), got {spec.requests:,}")
        for key in ("max_prompt_tokens", "max_output_tokens"):
            if cfg.get(key) is not None:
                setattr(spec, key, int_at_least(cfg[key], 1, f"{path}.{key}"))
        spec.n = int_at_least(cfg.get("n", 1), 1, f"{path}.n")
        if spec.n > MAX_N_SEQUENCES:  # SamplingParams' own limit, reported at its field
            raise ConfigError(f"{path}.n", f"must be in [1, {MAX_N_SEQUENCES}], got {spec.n:,}")
        prio = cfg.get("priority", 0)
        prios = prio if isinstance(prio, (list, tuple)) else [prio]
        if not prios:
            raise ConfigError(f"{path}.priority", "must be an integer or a non-empty list")
        spec.priority = tuple(as_int(p, f"{path}.priority") for p in prios)
        spec.finish = one_of(cfg.get("finish", "max_tokens"), ("max_tokens", "eos"),
                             f"{path}.finish")
        if cfg.get("timeout_s") is not None:
            spec.timeout_s = positive(cfg["timeout_s"], f"{path}.timeout_s")
        if spec.finish == "eos" and spec.max_output_tokens is None:
            raise ConfigError(f"{path}.max_output_tokens", "required when finish is 'eos' "
                             "(it becomes every request's max_tokens)")
        if is_trace:
            for key in ("prompt_tokens", "output_tokens", "shared_prefix", "lengths", "conversations"):
                if key in cfg:
                    raise ConfigError(f"{path}.{key}", f"not allowed with {source} "
                                                       "(the trace gives the lengths)")
            return spec
        if "conversations" in cfg:
            return _with_conversations(spec, cfg, path)
        if "lengths" in cfg:
            for key in ("prompt_tokens", "output_tokens", "shared_prefix", "max_prompt_tokens"):
                if key in cfg:
                    raise ConfigError(f"{path}.{key}", f"not allowed with {path}.lengths (it draws the prompt and "
                                      f"output lengths together, under its own limits)")
            spec.lengths = parse_joint_lengths(cfg["lengths"], f"{path}.lengths")
            if spec.requests is None:
                raise ConfigError(f"{path}.requests", "required field is missing")
            return spec
        if "output_tokens" in cfg:
            spec.output_tokens = parse_length_dist(cfg["output_tokens"], f"{path}.output_tokens")
        if "shared_prefix" in cfg:
            if "prompt_tokens" in cfg:
                raise ConfigError(f"{path}.prompt_tokens", f"not allowed with {path}.shared_prefix "
                                                           f"(use {path}.shared_prefix.suffix_tokens)")
            spec.shared_prefix = _parse_prefix(cfg["shared_prefix"], f"{path}.shared_prefix", spec.vocab_size)
            total = _prefix_request_count(spec)
            if spec.requests is not None and spec.requests != total:
                raise ConfigError(f"{path}.requests", f"{spec.requests} disagrees with "
                                 + ("the stages' requests (int(rate x duration_s) summed)"
                                    if isinstance(spec.arrival, StageLadder) and spec.shared_prefix.order == "inference_perf"
                                    else "shared_prefix.groups * shared_prefix.per_group"
                                    + (" * shared_prefix.repeat" if spec.shared_prefix.repeat > 1 else ""))
                                 + f" = {total}")
            spec.requests = total
            if total > MAX_REQUESTS:
                raise ConfigError(f"{path}.shared_prefix", f"groups * per_group * repeat = {total:,} requests, at most "
                                  f"{MAX_REQUESTS:,} per run")
            if spec.max_prompt_tokens is not None and spec.shared_prefix.prefix_tokens >= spec.max_prompt_tokens:
                raise ConfigError(f"{path}.shared_prefix.prefix_tokens", f"{spec.shared_prefix.prefix_tokens} leaves "
                                 f"no room under max_prompt_tokens {spec.max_prompt_tokens}")
        else:
            if "prompt_tokens" in cfg:
                spec.prompt_tokens = parse_length_dist(cfg["prompt_tokens"], f"{path}.prompt_tokens")
            if spec.requests is None:
                raise ConfigError(f"{path}.requests", "required field is missing")
        return spec


def _with_conversations(spec: WorkloadSpec, cfg: Any, path: str) -> WorkloadSpec:
    for key in ("requests", "prompt_tokens", "output_tokens", "shared_prefix", "lengths", "max_prompt_tokens"):
        if key in cfg:
            raise ConfigError(f"{path}.{key}", f"not allowed with {path}.conversations (it sets the turns and "
                              "their lengths; max_context_tokens bounds a conversation)")
    if spec.n != 1:
        raise ConfigError(f"{path}.n", "must be 1 with conversations (the next turn holds one answer)")
    spec.conversations = parse_conversations(cfg["conversations"], f"{path}.conversations")
    check_start_process(spec.arrival, f"{path}.arrival")
    spec.arrival = ConversationArrivals(spec.arrival)
    return spec


def _prefix_request_count(spec: WorkloadSpec) -> int:
    """Requests of a shared-prefix workload: one per prompt; with order inference_perf under a stage ladder,
    the stages' counts (each stage sends the prompt list from its start again)."""
    pg = spec.shared_prefix
    if pg.order == "inference_perf" and isinstance(spec.arrival, StageLadder):
        return sum(spec.arrival.stage_counts())
    return pg.groups * pg.per_group * pg.repeat


def _parse_prefix(cfg: Any, path: str, vocab_size: Optional[int]) -> PrefixGroups:
    cfg = check_mapping(cfg, path)
    check_keys(cfg, {"groups", "per_group", "prefix_tokens", "suffix_tokens", "order", "repeat"}, path,
               required=["groups", "per_group", "prefix_tokens"])
    groups = int_at_least(cfg["groups"], 1, f"{path}.groups")
    order = one_of(cfg.get("order", "grouped"), ("grouped", "interleaved", "shuffled", "inference_perf"), f"{path}.order")
    repeat = int_at_least(cfg.get("repeat", 1), 1, f"{path}.repeat")
    if repeat > 1 and order == "inference_perf":
        raise ConfigError(f"{path}.repeat", "not with order inference_perf (its stages resend the one list)")
    pg = PrefixGroups(
        groups=groups,
        per_group=int_at_least(cfg["per_group"], 1, f"{path}.per_group"),
        prefix_tokens=int_at_least(cfg["prefix_tokens"], 1, f"{path}.prefix_tokens"),
        suffix_tokens=parse_length_dist(cfg.get("suffix_tokens", 0), f"{path}.suffix_tokens", min_value=0),
        order=order, repeat=repeat,
    )
    if vocab_size is not None:
        _check_first_tokens(pg, vocab_size, path)
    return pg


def _check_first_tokens(pg: PrefixGroups, vocab_size: int, path: str) -> None:
    """Every group of the run (groups x repeat) starts with a token of its own: there must be that many."""
    if pg.groups * pg.repeat > vocab_size:
        raise ConfigError(f"{path}.groups", f"{pg.groups * pg.repeat} groups cannot all start with a different token "
                          f"in a vocabulary of {vocab_size}" + (f" (groups x repeat {pg.repeat})" if pg.repeat > 1 else ""))


def rng_streams(seed: int) -> dict[str, np.random.Generator]:
    """Independent generators per purpose, all derived from `seed`."""
    children = np.random.SeedSequence(seed).spawn(len(_STREAMS))
    return {name: np.random.default_rng(ss) for name, ss in zip(_STREAMS, children)}


def _cap(x: np.ndarray, cap: Optional[int]) -> np.ndarray:
    return np.minimum(x, cap) if cap is not None else x


DEFAULT_VOCAB_SIZE = 32000  # prompts' token range when neither the workload nor a model gives one


def _with_vocab(spec: WorkloadSpec, vocab_size: Optional[int]) -> WorkloadSpec:
    """`spec` with its vocabulary fixed: its own (at most the model's), else the model's."""
    if spec.vocab_size is not None:
        if vocab_size is not None and spec.vocab_size > vocab_size:
            raise ConfigError(f"{spec.path}.vocab_size",
                              f"{spec.vocab_size} exceeds the model's vocabulary ({vocab_size})")
        return spec
    spec = dataclasses.replace(spec, vocab_size=vocab_size or DEFAULT_VOCAB_SIZE)
    if spec.shared_prefix is not None:
        _check_first_tokens(spec.shared_prefix, spec.vocab_size, f"{spec.path}.shared_prefix")
    return spec


def generate_requests(spec: WorkloadSpec, id_prefix: Optional[str] = None,
                      vocab_size: Optional[int] = None) -> list[WorkloadRequest]:
    """All requests of the workload, sorted by arrival (closed-loop: arrival_s = 0 until issued;
    conversations: by conversation, then turn). `vocab_size`: the model's vocabulary (prompts are
    drawn below it). Ids: `{id_prefix}N`, id_prefix "req-" by default; `{id_prefix}conv-C-turn-K`
    for conversations, id_prefix "" by default."""
    spec = _with_vocab(spec, vocab_size)
    rng = rng_streams(spec.seed)
    if spec.conversations is not None:
        return _conversation_requests(spec, rng, id_prefix or "")
    id_prefix = "req-" if id_prefix is None else id_prefix
    if spec.trace is not None:
        records = spec.trace.records[:spec.requests] if spec.requests else spec.trace.records
        check_run_memory(len(records), sum(r.prompt_tokens for r in records),
                         sum(r.output_tokens for r in records), spec.trace_field)
        prompts, outputs, groups = _trace_prompts(list(records), spec, rng["tokens"], spec.trace.hash_block_tokens)
    elif spec.shared_prefix is not None:
        prompts, groups = _group_prompts(spec, rng["tokens"], rng["lengths"], rng["order"])
        outputs = spec.output_tokens.sample(rng["lengths"], len(prompts))
    else:
        n = spec.requests or 0
        if spec.lengths is not None:
            lens, joint_outputs = spec.lengths.sample(rng["lengths"], n)
        else:
            lens = _cap(spec.prompt_tokens.sample(rng["lengths"], n), spec.max_prompt_tokens)
        total = int(np.sum(lens, dtype=np.float64))
        if total > MAX_PROMPT_TOKENS:
            raise ConfigError(f"{spec.path}.prompt_tokens", f"{n:,} requests draw {total:,} prompt tokens, at "
                              f"most {MAX_PROMPT_TOKENS:,} per run (lower workload.requests or the prompt lengths)")
        outputs = joint_outputs if spec.lengths is not None else spec.output_tokens.sample(rng["lengths"], n)
        check_run_memory(n, total, int(np.sum(_cap(np.asarray(outputs), spec.max_output_tokens), dtype=np.float64)),
                         f"{spec.path}.requests")
        prompts = draw_token_lists(rng["tokens"], spec.vocab_size, lens)
        groups = [None] * n
    count = len(prompts)
    outputs = _cap(np.asarray(outputs, dtype=np.int64), spec.max_output_tokens)
    prios = rng["priority"].choice(np.asarray(spec.priority), size=count)
    times = (np.zeros(count) if spec.arrival.closed_loop
             else spec.arrival.times(count, rng["arrivals"]))
    requests = []
    for i in range(count):
        out = int(outputs[i])
        eos = spec.finish == "eos"
        requests.append(WorkloadRequest(
            request_id=f"{id_prefix}{i}", arrival_s=float(times[i]), prompt_token_ids=prompts[i],
            max_tokens=int(spec.max_output_tokens) if eos else out, n=spec.n,
            priority=int(prios[i]), group=groups[i], eos_at=out if eos else None, timeout_s=spec.timeout_s))
    return requests


def _conversation_requests(spec: WorkloadSpec, rng: dict[str, np.random.Generator],
                           id_prefix: str) -> list[WorkloadRequest]:
    """Every planned turn of every conversation; a later turn's prompt holds placeholder answer tokens
    until `ConversationArrivals` rebuilds it from the engine's answer (servetwin.sim.conversation)."""
    cs = spec.conversations
    assert cs is not None
    lens = rng["lengths"]
    num_turns = cs.turns.sample(lens, cs.count)
    first = cs.first_prompt.sample(lens, cs.count)
    total = int(num_turns.sum())
    messages = cs.message_tokens.sample(lens, total)
    outputs = _cap(cs.output_tokens.sample(lens, total), spec.max_output_tokens)
    thinks = think_times(cs, rng["think"], total)
    start = spec.arrival.start
    starts = np.zeros(cs.count) if start.closed_loop else start.times(cs.count, rng["arrivals"])
    prios = rng["priority"].choice(np.asarray(spec.priority), size=total)
    eos = spec.finish == "eos"
    requests: list[WorkloadRequest] = []
    planned_prompt_tokens = 0
    j = 0  # index of the turn across conversations (into messages, outputs, ...)
    for c in range(cs.count):
        prompt: list[int] = []
        for k in range(1, int(num_turns[c]) + 1):
            out, m = int(outputs[j]), int(first[c] if k == 1 else messages[j])
            size = len(prompt) + m
            if k > 1 and cs.max_context_tokens is not None and size + out > cs.max_context_tokens:
                j += int(num_turns[c]) - k + 1  # the context is full: the conversation ends
                break
            message = draw_tokens(rng["tokens"], spec.vocab_size, m)
            prompt = prompt + message
            planned_prompt_tokens += len(prompt)
            if planned_prompt_tokens > MAX_PROMPT_TOKENS:
                raise ConfigError(f"{spec.path}.conversations", f"the turns' prompts hold over {MAX_PROMPT_TOKENS:,} "
                                  "tokens in all (every turn repeats its history): fewer conversations or turns, "
                                  "or set max_context_tokens")
            requests.append(WorkloadRequest(
                request_id=f"{id_prefix}conv-{c}-turn-{k}", arrival_s=float(starts[c]), prompt_token_ids=prompt,
                max_tokens=int(spec.max_output_tokens) if eos else out, priority=int(prios[j]),
                eos_at=out if eos else None, timeout_s=spec.timeout_s,
                conversation=ConversationTurn(c, k, m, float(thinks[j]) if k > 1 else 0.0),
                keep_output_tokens=True))
            prompt = prompt + [ANSWER_PLACEHOLDER] * out
            j += 1
    return requests


def _group_prompts(spec: WorkloadSpec, tok: np.random.Generator, lens: np.random.Generator,
                   order_rng: np.random.Generator) -> tuple[list[list[int]], list[Optional[int]]]:
    pg = spec.shared_prefix
    assert pg is not None
    all_groups = pg.groups * pg.repeat  # (repeat 1: the draws of the plain pattern, in the same order)
    first = tok.permutation(spec.vocab_size)[:all_groups]
    prefixes = []
    for g in range(all_groups):
        rest = tok.integers(0, spec.vocab_size, size=pg.prefix_tokens - 1)
        prefixes.append([int(first[g])] + rest.tolist())
    suffix_cap = (spec.max_prompt_tokens - pg.prefix_tokens
                  if spec.max_prompt_tokens is not None else None)
    suffixes = _cap(pg.suffix_tokens.sample(lens, all_groups * pg.per_group), suffix_cap)
    if pg.order == "inference_perf":
        return _inference_perf_prompts(spec, prefixes, suffixes, tok, order_rng)
    pairs = []
    for r in range(pg.repeat):  # each time the pattern, with its own groups
        g0 = r * pg.groups
        if pg.order == "grouped":
            block = [(g0 + g, m) for g in range(pg.groups) for m in range(pg.per_group)]
        else:
            block = [(g0 + g, m) for m in range(pg.per_group) for g in range(pg.groups)]
            if pg.order == "shuffled":
                block = [block[i] for i in order_rng.permutation(len(block))]
        pairs += block
    prompts, groups = [], []
    for i, (g, _m) in enumerate(pairs):
        suffix = draw_tokens(tok, spec.vocab_size, int(suffixes[i]))
        prompts.append(prefixes[g] + suffix)
        groups.append(g)
    return prompts, groups


def _inference_perf_prompts(spec: WorkloadSpec, prefixes: list[list[int]], suffixes: np.ndarray,
                            tok: np.random.Generator, order_rng: np.random.Generator
                            ) -> tuple[list[list[int]], list[Optional[int]]]:
    """inference-perf's shared_prefix data (`datagen/shared_prefix_datagen.py`, `synthetic/` in newer versions):
    the prompts are made group by group (one system prompt per group, one question per prompt), shuffled once,
    and every load stage sends them from the first again (`get_data()` restarts at index 0 in each
    `run_stage`), wrapping around the list; a prompt sent twice is the same text."""
    pg = spec.shared_prefix
    pairs = [(g, m) for g in range(pg.groups) for m in range(pg.per_group)]
    base = [prefixes[g] + draw_tokens(tok, spec.vocab_size, int(suffixes[i])) for i, (g, _m) in enumerate(pairs)]
    base_groups = [g for g, _m in pairs]
    order = order_rng.permutation(len(base))
    base, base_groups = [base[i] for i in order], [base_groups[i] for i in order]
    counts = spec.arrival.stage_counts() if isinstance(spec.arrival, StageLadder) else [len(base)]
    idx = [j % len(base) for n in counts for j in range(n)]
    return [base[i] for i in idx], [base_groups[i] for i in idx]  # a resent prompt: the same list (read only)


def _hash_block_prompt(ids: tuple[int, ...], length: int, blocks: dict[int, list[int]], size: int,
                       vocab: int, tok: np.random.Generator) -> list[int]:
    """A prompt of `length` tokens made of the blocks behind its hash ids (a block's tokens are drawn
    once, the first time its id appears, so equal ids give equal blocks and the prefix cache sees the
    trace's sharing); tokens past the last id's block are the request's own."""
    out: list[int] = []
    for h in ids:
        if len(out) >= length:
            break
        if h not in blocks:
            blocks[h] = draw_tokens(tok, vocab, size)
        out.extend(blocks[h])
    if len(out) < length:
        out.extend(draw_tokens(tok, vocab, length - len(out)))
    return out[:length]


def _trace_prompts(records: list[TraceRecord], spec: WorkloadSpec, tok: np.random.Generator,
                   hash_block_tokens: int = 512) -> tuple[list[list[int]], list[int], list[Optional[int]]]:
    """Prompts for trace records: members of a prefix group share the group's leading tokens; records
    with hash ids are built block by block from them."""
    group_ids: dict[str, int] = {}
    group_len: dict[str, int] = {}
    for r in records:
        if r.prefix_group is not None:
            group_ids.setdefault(r.prefix_group, len(group_ids))
            group_len[r.prefix_group] = max(group_len.get(r.prefix_group, 0), r.prefix_tokens)
    if len(group_ids) > spec.vocab_size:
        raise ConfigError(spec.trace_field, f"{len(group_ids)} prefix groups cannot all start "
                         f"with a different token in a vocabulary of {spec.vocab_size}")
    first = tok.permutation(spec.vocab_size)[:max(1, len(group_ids))]
    shared = {}
    for name, gid in group_ids.items():
        rest = draw_tokens(tok, spec.vocab_size, max(0, group_len[name] - 1))
        shared[name] = ([int(first[gid])] + rest) if group_len[name] > 0 else []
    prompts, outputs, groups = [], [], []
    blocks: dict[int, list[int]] = {}
    for r in records:
        if r.hash_ids is not None:
            plen = r.prompt_tokens if spec.max_prompt_tokens is None else min(r.prompt_tokens, spec.max_prompt_tokens)
            prompts.append(_hash_block_prompt(r.hash_ids, plen, blocks, hash_block_tokens, spec.vocab_size, tok))
            outputs.append(r.output_tokens)
            groups.append(None)
            continue
        prefix = shared[r.prefix_group][:r.prefix_tokens] if r.prefix_group is not None else []
        plen = r.prompt_tokens if spec.max_prompt_tokens is None else min(r.prompt_tokens,
                                                                          spec.max_prompt_tokens)
        plen = max(plen, len(prefix))
        suffix = draw_tokens(tok, spec.vocab_size, plen - len(prefix))
        prompts.append(prefix + suffix)
        outputs.append(r.output_tokens)
        groups.append(group_ids[r.prefix_group] if r.prefix_group is not None else None)
    return prompts, outputs, groups


def build_workload(cfg: Any, vocab_size: Optional[int] = None, path: str = "workload",
                   id_prefix: Optional[str] = None) -> tuple[WorkloadSpec, list[WorkloadRequest]]:
    """Parse a workload config and generate its requests."""
    spec = WorkloadSpec.from_dict(cfg, path, vocab_size=vocab_size)
    return spec, generate_requests(spec, id_prefix, vocab_size)
