"""The scenario contract's speculative-decoding keys (`docs/scenario_speculative.md`), parsed once.

`settings.speculative` = `{"num_speculative_tokens": k, "method": "ngram" | "eagle" | "mtp",
"acceptance": "all" | "none" | {"seed": S} | {"pattern": [a, ...]}}`; per request `draft_lengths`
(what the fake drafter proposes, cycled; sync scheduling only) and `accept_pattern` (what the fake
rejection sampler accepts, cycled). The inputs rejected here are those vLLM 0.33's oracle driver
rejects. Errors are `ConfigError`s naming the field; `scenario.py` turns them into `ScenarioError`s.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from servetwin.core.config_error import ConfigError
from servetwin.core.sched.spec_decode import SpeculativeConfig

SPEC_METHODS = ("ngram", "eagle", "mtp")  # the recorded oracle's methods (no draft model there)

SPEC_KEYS = ("num_speculative_tokens", "method", "acceptance")
REQUEST_SPEC_KEYS = ("draft_lengths", "accept_pattern")

# "all" | "none" | ("seed", S) | ("pattern", [a, ...])
Acceptance = Union[str, tuple[str, Any]]


@dataclass(slots=True)
class SpecScenario:
    """`settings.speculative`: vLLM's config plus the fake rejection sampler's default rule."""
    config: SpeculativeConfig
    acceptance: Acceptance = "all"


def _is_int(v: Any, minimum: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= minimum


def _int_list(v: Any, path: str) -> list[int]:
    if not (isinstance(v, list) and v and all(_is_int(x, 0) for x in v)):
        raise ConfigError(path, f"must be a non-empty list of integers >= 0, got {v!r}")
    return list(v)


def _acceptance(v: Any, path: str) -> Acceptance:
    if v in ("all", "none"):
        return v
    if isinstance(v, dict) and set(v) == {"seed"} and _is_int(v["seed"], 0):
        return ("seed", v["seed"])
    if isinstance(v, dict) and set(v) == {"pattern"}:
        return ("pattern", _int_list(v["pattern"], f"{path}.pattern"))
    raise ConfigError(path, 'must be "all", "none", {"seed": int >= 0} or {"pattern": [ints >= 0]}, '
                      f"got {v!r}")


def parse_speculative(raw: Any, max_num_batched_tokens: int, async_scheduling: bool) -> SpecScenario:
    """`settings.speculative`; paths are relative to `settings`."""
    path = "speculative"
    if not isinstance(raw, dict):
        raise ConfigError(path, f"must be an object, got {raw!r}")
    for key in raw:
        if key not in SPEC_KEYS:
            raise ConfigError(f"{path}.{key}", f"unknown key (allowed: {', '.join(SPEC_KEYS)})")
    k = raw.get("num_speculative_tokens")
    if not _is_int(k, 1):
        raise ConfigError(f"{path}.num_speculative_tokens", f"required, an integer >= 1, got {k!r}")
    method = raw.get("method", "ngram")
    if method not in SPEC_METHODS:
        raise ConfigError(f"{path}.method", f"must be one of {', '.join(SPEC_METHODS)}, got {method!r}")
    config = SpeculativeConfig(num_speculative_tokens=k, method=method)
    try:
        config.check(max_num_batched_tokens, async_scheduling)
    except ConfigError as e:
        raise e.within(path) from None
    return SpecScenario(config, _acceptance(raw.get("acceptance", "all"), f"{path}.acceptance"))


def parse_request_spec_fields(r: dict, where: str, spec: Optional[SpecScenario],
                              async_scheduling: bool) -> tuple[Optional[list[int]], Optional[list[int]]]:
    """A request's `draft_lengths` and `accept_pattern` (None when absent)."""
    out = []
    for key in REQUEST_SPEC_KEYS:
        if key not in r:
            out.append(None)
            continue
        if spec is None:
            raise ConfigError(f"{where}.{key}", "needs settings.speculative")
        out.append(_int_list(r[key], f"{where}.{key}"))
    draft_lengths = out[0]
    if draft_lengths is not None:
        k = spec.config.num_speculative_tokens
        if max(draft_lengths) > k:
            raise ConfigError(f"{where}.draft_lengths", f"at most num_speculative_tokens ({k}), got "
                              f"{max(draft_lengths)}")
        if async_scheduling:
            raise ConfigError(f"{where}.draft_lengths", "sync scheduling only (the async scheduler "
                              "schedules num_speculative_tokens placeholder drafts itself)")
    return draft_lengths, out[1]
