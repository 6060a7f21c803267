"""Joint (prompt, output) length sampling with vLLM's benchmark limits (`workload.lengths`).

vLLM's ShareGPT sampler (vllm-project/vllm, `vllm/benchmarks/datasets.py`: `ShareGPTDataset.sample`
walks the shuffled dataset and skips every pair for which `is_valid_sequence(prompt_len, output_len,
min_len=4, max_prompt_len=1024, max_total_len=2048, skip_min_output_len_check=...)` is false; the
output check is skipped when `--sharegpt-output-len` fixes the output length) keeps a pair only if

    prompt >= min_tokens, output >= min_tokens (unless the output length is fixed),
    prompt <= max_prompt_tokens, prompt + output <= max_total_tokens.

Skipping invalid records of a shuffled dataset is rejection sampling from the dataset's pair
distribution; here the pairs come from two length distributions drawn independently
(`sharegpt_like`) or from a file of recorded pairs (`empirical`), and rejected pairs are drawn again:

    lengths:
      type: sharegpt_like             # or empirical
      prompt: {type: lognormal, mean: 300, cv: 1.2}   # servetwin.sim.lengths forms
      output: {type: lognormal, mean: 250, cv: 1.0}
      # empirical: path: pairs.csv (two columns: prompt, output tokens) or pairs: [[p, o], ...]
      min_tokens: 4                   # vLLM's defaults; null disables a max limit
      max_prompt_tokens: 1024
      max_total_tokens: 2048

Draws come from the workload's `lengths` stream in batches whose sizes depend only on the counts so
far, so a seed gives the same pairs every time. A draw budget (`MIN_ACCEPTANCE`) turns limits that
reject nearly every pair into an error naming the field and the share each limit rejected.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol

import numpy as np

from servetwin.core.config_error import ConfigError
from servetwin.sim.lengths import Fixed, LengthDist, parse_length_dist
from servetwin.sim.validate import check_keys, check_mapping, int_at_least

# vLLM's `is_valid_sequence` defaults (vllm/benchmarks/datasets.py)
VLLM_MIN_TOKENS = 4
VLLM_MAX_PROMPT_TOKENS = 1024
VLLM_MAX_TOTAL_TOKENS = 2048
MIN_ACCEPTANCE = 0.01  # below 1 accepted pair in 100 drawn, the limits are called a mistake
MAX_BATCH = 1 << 20  # pairs drawn at once (bounds the temporary arrays)


@dataclass(slots=True, frozen=True)
class PairLimits:
    min_tokens: int = VLLM_MIN_TOKENS
    max_prompt_tokens: Optional[int] = VLLM_MAX_PROMPT_TOKENS
    max_total_tokens: Optional[int] = VLLM_MAX_TOTAL_TOKENS
    check_min_output: bool = True  # False: a fixed output length (vLLM's skip_min_output_len_check)

    def violations(self, prompt: np.ndarray, output: np.ndarray) -> dict[str, np.ndarray]:
        """Per limit, which pairs break it (a pair may break several)."""
        out = {"prompt < min_tokens": prompt < self.min_tokens}
        if self.check_min_output:
            out["output < min_tokens"] = output < self.min_tokens
        if self.max_prompt_tokens is not None:
            out["prompt > max_prompt_tokens"] = prompt > self.max_prompt_tokens
        if self.max_total_tokens is not None:
            out["prompt + output > max_total_tokens"] = prompt + output > self.max_total_tokens
        return out

    def valid(self, prompt: np.ndarray, output: np.ndarray) -> np.ndarray:
        ok = np.ones(len(prompt), dtype=bool)
        for bad in self.violations(prompt, output).values():
            ok &= ~bad
        return ok


class PairSource(Protocol):
    def draw(self, rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray]: ...


@dataclass(slots=True, frozen=True)
class IndependentPairs:
    """Prompt and output lengths from their own distributions (a batch of prompts, then of outputs)."""
    prompt: LengthDist
    output: LengthDist

    def draw(self, rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray]:
        return self.prompt.sample(rng, size), self.output.sample(rng, size)


@dataclass(slots=True, frozen=True)
class EmpiricalPairs:
    """Recorded (prompt, output) pairs, drawn uniformly with replacement."""
    prompt: tuple[int, ...]
    output: tuple[int, ...]

    def draw(self, rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray]:
        idx = rng.integers(0, len(self.prompt), size=size)
        return np.asarray(self.prompt, dtype=np.int64)[idx], np.asarray(self.output, dtype=np.int64)[idx]


@dataclass(slots=True, frozen=True)
class JointLengths:
    kind: str  # sharegpt_like | empirical
    source: PairSource
    limits: PairLimits
    path: str = "workload.lengths"

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """`n` (prompt, output) pairs that meet the limits, in draw order."""
        prompts, outputs = [], []
        got = drawn = 0
        budget = 1000 + math.ceil(n / MIN_ACCEPTANCE)
        counts: dict[str, int] = {}
        while got < n:
            if drawn >= budget:
                self._too_strict(got, drawn, counts)
            rate = got / drawn if drawn else 1.0
            size = min(MAX_BATCH, budget - drawn, math.ceil((n - got) / max(rate, MIN_ACCEPTANCE) * 1.1) + 16)
            p, o = self.source.draw(rng, size)
            for name, bad in self.limits.violations(p, o).items():
                counts[name] = counts.get(name, 0) + int(bad.sum())
            ok = self.limits.valid(p, o)
            keep = min(int(ok.sum()), n - got)
            prompts.append(p[ok][:keep])
            outputs.append(o[ok][:keep])
            got += keep
            drawn += size
        if not prompts:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return np.concatenate(prompts), np.concatenate(outputs)

    def _too_strict(self, got: int, drawn: int, counts: dict[str, int]) -> None:
        why = ", ".join(f"{name}: {c / drawn:.1%}" for name, c in counts.items() if c)
        raise ConfigError(self.path, f"the limits accepted {got:,} of {drawn:,} drawn pairs ({got / drawn:.2%}, "
                                     f"under the {MIN_ACCEPTANCE:.0%} this sampler allows); rejected by {why}: "
                                     "widen the limits or move the length distributions inside them")


def read_pairs_file(path: str | Path, field_path: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Two integer columns (prompt, output tokens) split by a comma, tab or spaces; `#` comments; the
    first line may be a header (e.g. `prompt_tokens,output_tokens`)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(field_path, f"file not found: {p}")
    prompts: list[int] = []
    outputs: list[int] = []
    first = True
    with open(p, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            cells = text.replace(",", " ").split()
            if first and not all(_is_number(c) for c in cells):
                first = False
                continue  # a header line
            first = False
            where = f"{field_path}: {p}:{lineno}"
            if len(cells) != 2 or not all(_is_number(c) for c in cells):
                raise ConfigError(where, f"expected two integer lengths (prompt, output), got {text!r}")
            prompts.append(_length(cells[0], where))
            outputs.append(_length(cells[1], where))
    if not prompts:
        raise ConfigError(field_path, f"{p} holds no (prompt, output) pairs")
    return tuple(prompts), tuple(outputs)


def _is_number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True


def _length(cell: str, where: str) -> int:
    x = float(cell)
    if not x.is_integer() or x < 0:
        raise ConfigError(where, f"not a token count: {cell!r}")
    return int(x)


_KEYS = {"sharegpt_like": {"prompt", "output"}, "empirical": {"path", "pairs"}}
_LIMIT_KEYS = {"min_tokens", "max_prompt_tokens", "max_total_tokens"}


def parse_joint_lengths(cfg: Any, path: str = "workload.lengths") -> JointLengths:
    """Build the sampler from its config; every error names its field."""
    cfg = check_mapping(cfg, path)
    kind = cfg.get("type")
    if kind not in _KEYS:
        raise ConfigError(f"{path}.type", f"must be one of {', '.join(map(repr, _KEYS))}, got {kind!r}")
    check_keys(cfg, _KEYS[kind] | _LIMIT_KEYS | {"type"}, path,
               required=["prompt", "output"] if kind == "sharegpt_like" else [])
    check_output = True
    if kind == "sharegpt_like":
        output = parse_length_dist(cfg["output"], f"{path}.output")
        source: PairSource = IndependentPairs(parse_length_dist(cfg["prompt"], f"{path}.prompt"), output)
        check_output = not isinstance(output, Fixed)  # vLLM skips the check for a fixed output length
    else:
        if ("path" in cfg) == ("pairs" in cfg):
            raise ConfigError(path, "give exactly one of 'path' or 'pairs'")
        if "path" in cfg:
            source = EmpiricalPairs(*read_pairs_file(cfg["path"], f"{path}.path"))
        else:
            source = EmpiricalPairs(*_inline_pairs(cfg["pairs"], f"{path}.pairs"))
    min_tokens = int_at_least(cfg.get("min_tokens", VLLM_MIN_TOKENS), 1, f"{path}.min_tokens")
    max_prompt = _optional_limit(cfg, "max_prompt_tokens", VLLM_MAX_PROMPT_TOKENS, min_tokens, path)
    smallest_total = min_tokens + (min_tokens if check_output else 1)
    max_total = _optional_limit(cfg, "max_total_tokens", VLLM_MAX_TOTAL_TOKENS, smallest_total, path)
    return JointLengths(kind, source, PairLimits(min_tokens, max_prompt, max_total, check_output), path)


def _optional_limit(cfg: Any, key: str, default: int, low: int, path: str) -> Optional[int]:
    if key not in cfg:
        return default
    if cfg[key] is None:
        return None
    return int_at_least(cfg[key], low, f"{path}.{key}")


def _inline_pairs(raw: Any, path: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if not isinstance(raw, (list, tuple)) or not raw:
        raise ConfigError(path, "must be a non-empty list of [prompt, output] pairs")
    prompts, outputs = [], []
    for i, pair in enumerate(raw):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ConfigError(f"{path}[{i}]", f"must be a [prompt, output] pair, got {pair!r}")
        prompts.append(int_at_least(pair[0], 0, f"{path}[{i}][0]"))
        outputs.append(int_at_least(pair[1], 0, f"{path}[{i}][1]"))
    return tuple(prompts), tuple(outputs)
