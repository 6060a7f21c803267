"""Batch composition of a step and vLLM's profiler annotation (`compute_iteration_details`)."""
from __future__ import annotations

from dataclasses import dataclass

from servetwin.core.sched.output import SchedulerOutput


@dataclass(slots=True, frozen=True)
class IterationDetails:
    num_ctx_requests: int
    num_ctx_tokens: int
    num_generation_requests: int
    num_generation_tokens: int

    @property
    def annotation(self) -> str:
        return (f"execute_context_{self.num_ctx_requests}({self.num_ctx_tokens})"
                f"_generation_{self.num_generation_requests}({self.num_generation_tokens})")


def context_request_ids(so: SchedulerOutput) -> set[str]:
    """New requests and cached ones with no output yet (a continuing chunked prefill) are context."""
    ctx = {r.req_id for r in so.scheduled_new_reqs}
    cached = so.scheduled_cached_reqs
    for rid, n_out in zip(cached.req_ids, cached.num_output_tokens):
        if n_out == 0:
            ctx.add(rid)
    return ctx


def compute_iteration_details(so: SchedulerOutput) -> IterationDetails:
    ctx = context_request_ids(so)
    n_ctx = t_ctx = n_gen = t_gen = 0
    for rid, n in so.num_scheduled_tokens.items():
        if rid in ctx:
            n_ctx += 1
            t_ctx += n
        else:
            n_gen += 1
            t_gen += n
    return IterationDetails(n_ctx, t_ctx, n_gen, t_gen)


def parse_annotation(annotation: str) -> IterationDetails:
    """Inverse of `IterationDetails.annotation`."""
    import re
    m = re.fullmatch(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)", annotation)
    if not m:
        raise ValueError(f"annotation: not an execute_context_X(a)_generation_Y(b) string: {annotation!r}")
    return IterationDetails(*(int(g) for g in m.groups()))
