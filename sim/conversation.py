"""Multi-turn conversations (`workload.conversations`): each turn's prompt is the conversation's
history - the previous turn's prompt and the answer the engine produced for it - plus a new user
message, so the prefix cache sees the shared history as it does for a chat client.

    workload:
      conversations:
        count: 64                                # conversations
        turns: {type: uniform, low: 2, high: 6}  # turns per conversation (an int or a length form)
        first_prompt: {type: lognormal, mean: 400, cv: 0.5}   # system prompt + first user message
        message_tokens: {type: lognormal, mean: 60, cv: 1.0}  # each later user message
        output_tokens: {type: lognormal, mean: 200, cv: 0.8}  # each answer
        think_time_s: 2.0                        # the user's pause after an answer ...
        think: exponential                       # ... fixed (default) or exponential with that mean
        max_context_tokens: 4096                 # optional: the conversation ends before a turn whose
                                                 #   prompt + answer would exceed it
      arrival: {type: poisson, rate: 0.5}        # when conversations start (offline: all at t = 0;
                                                 #   closed_loop: `clients` users, one conversation
                                                 #   after another)

Every length, message token and think time is drawn when the workload is generated (so a seed gives
the same conversations whatever the engine does); only the answers come from the run. Turn k + 1 is
submitted when turn k completes (at the client: after the front end delivered its last chunk) plus
the think time. Its prompt is then rebuilt from the exact token ids the engine produced for turn k
(`WorkloadRequest.output_token_ids`, which `servetwin.sim.engine.Simulation` fills for requests that
ask for it with `keep_output_tokens`), since vLLM's prefix cache hashes full blocks of prompt and
output tokens. Before that, the prompt of a later turn holds placeholder answer tokens of the
planned length (the lengths in the workload summary are the planned ones). A turn that is rejected
(never servable) or aborted (`workload.timeout_s`) ends its conversation: its later turns are never
sent. Request ids: `conv-C-turn-K` (conversations from 0, turns from 1).
"""
from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import simpy

from servetwin.core.config_error import ConfigError
from servetwin.sim.arrivals import ArrivalProcess, ClosedLoop, Submit, TraceArrivals
from servetwin.sim.lengths import LengthDist, parse_length_dist
from servetwin.sim.validate import check_keys, check_mapping, int_at_least, non_negative, one_of

if TYPE_CHECKING:
    from servetwin.sim.workload import WorkloadRequest

MAX_CONVERSATIONS = 1_000_000
ANSWER_PLACEHOLDER = 0  # a later turn's answer tokens until the run produced them (never sent)


@dataclass(slots=True, frozen=True)
class ConversationsSpec:
    count: int
    turns: LengthDist
    first_prompt: LengthDist
    message_tokens: LengthDist
    output_tokens: LengthDist
    think_time_s: float = 0.0
    think: str = "fixed"  # fixed | exponential
    max_context_tokens: Optional[int] = None


@dataclass(slots=True, frozen=True)
class ConversationTurn:
    """Where a request sits in its conversation."""
    conversation: int
    turn: int  # 1 = the first
    message_tokens: int  # the new user message: the last `message_tokens` ids of the turn's prompt
    think_s: float = 0.0  # the user's pause between the previous turn's completion and this one


def parse_conversations(cfg: Any, path: str = "workload.conversations") -> ConversationsSpec:
    cfg = check_mapping(cfg, path)
    check_keys(cfg, {"count", "turns", "first_prompt", "message_tokens", "output_tokens", "think_time_s",
                     "think", "max_context_tokens"}, path,
               required=["count", "turns", "first_prompt", "message_tokens", "output_tokens"])
    count = int_at_least(cfg["count"], 1, f"{path}.count")
    if count > MAX_CONVERSATIONS:
        raise ConfigError(f"{path}.count", f"at most {MAX_CONVERSATIONS:,} conversations per run, got {count:,}")
    max_ctx = cfg.get("max_context_tokens")
    return ConversationsSpec(
        count=count,
        turns=parse_length_dist(cfg["turns"], f"{path}.turns"),
        first_prompt=parse_length_dist(cfg["first_prompt"], f"{path}.first_prompt"),
        message_tokens=parse_length_dist(cfg["message_tokens"], f"{path}.message_tokens"),
        output_tokens=parse_length_dist(cfg["output_tokens"], f"{path}.output_tokens"),
        think_time_s=non_negative(cfg.get("think_time_s", 0.0), f"{path}.think_time_s"),
        think=one_of(cfg.get("think", "fixed"), ("fixed", "exponential"), f"{path}.think"),
        max_context_tokens=None if max_ctx is None else int_at_least(max_ctx, 2, f"{path}.max_context_tokens"),
    )


def check_start_process(start: ArrivalProcess, path: str) -> None:
    """Conversations start by an open-loop process or closed-loop users; a trace has its own requests."""
    if isinstance(start, TraceArrivals):
        raise ConfigError(f"{path}.type", "a trace gives its own requests; conversations start by offline, "
                                          "poisson, gamma or closed_loop arrivals")


def think_times(spec: ConversationsSpec, rng: np.random.Generator, size: int) -> np.ndarray:
    if spec.think_time_s <= 0:
        return np.zeros(size)
    if spec.think == "exponential":
        return rng.exponential(spec.think_time_s, size=size)
    return np.full(size, spec.think_time_s)


def next_prompt(previous: "WorkloadRequest", answer: list[int], turn: "WorkloadRequest") -> list[int]:
    """The prompt of `turn`: the previous turn's prompt and answer, then the turn's new message."""
    m = turn.conversation.message_tokens
    message = turn.prompt_token_ids[len(turn.prompt_token_ids) - m:]
    return previous.prompt_token_ids + answer + message


@dataclass(slots=True, frozen=True)
class ConversationArrivals:
    """Starts conversations by `start` and runs each one turn after turn (completion feedback, like
    a closed loop: a later turn's arrival time is set when it is sent)."""
    start: ArrivalProcess
    closed_loop = True

    def process(self, env: simpy.Environment, requests: Sequence["WorkloadRequest"], submit: Submit,
                rng: np.random.Generator) -> Generator[simpy.Event, Any, None]:
        conversations = _by_conversation(requests)
        if isinstance(self.start, ClosedLoop):
            queue = iter(conversations)
            users = [env.process(self._user(env, queue, submit, rng)) for _ in range(self.start.clients)]
            yield env.all_of(users)
            return
        runs = [env.process(self._conversation(env, turns, submit, turns[0].arrival_s)) for turns in conversations]
        yield env.all_of(runs)

    def _user(self, env: simpy.Environment, queue: Any, submit: Submit,
              rng: np.random.Generator) -> Generator[simpy.Event, Any, None]:
        """A closed-loop user: one conversation after another, the closed loop's think time between."""
        start = self.start
        for turns in queue:
            yield from self._conversation(env, turns, submit, env.now)
            think = start.think_time_s
            if start.think == "exponential" and think > 0:
                think = float(rng.exponential(think))
            if think > 0:
                yield env.timeout(think)

    @staticmethod
    def _conversation(env: simpy.Environment, turns: list["WorkloadRequest"], submit: Submit,
                      t_start: float) -> Generator[simpy.Event, Any, None]:
        if t_start > env.now:
            yield env.timeout(t_start - env.now)
        previous = None
        for req in turns:
            if previous is not None:
                answer = previous.output_token_ids
                if answer is None:  # rejected or aborted: the conversation ends here
                    return
                if req.conversation.think_s > 0:
                    yield env.timeout(req.conversation.think_s)
                req.prompt_token_ids = next_prompt(previous, answer, req)
            req.arrival_s = float(env.now)
            yield submit(req)
            previous = req


def _by_conversation(requests: Sequence["WorkloadRequest"]) -> list[list["WorkloadRequest"]]:
    """The requests grouped by conversation (in order of first appearance), each in turn order."""
    groups: dict[int, list["WorkloadRequest"]] = {}
    for req in requests:
        if req.conversation is None:
            raise ValueError(f"request {req.request_id!r} belongs to no conversation "
                             "(ConversationArrivals runs the requests of a `conversations` workload)")
        groups.setdefault(req.conversation.conversation, []).append(req)
    out = []
    for turns in groups.values():
        turns.sort(key=lambda r: r.conversation.turn)
        out.append(turns)
    return out
