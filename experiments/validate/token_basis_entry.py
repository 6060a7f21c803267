"""published.json's `token_basis` entries (`servetwin validate`'s engine-token basis): their shape, and that a
recorded client count agrees with the same published figures' out_tok_s / req_s. Checked when published.json is
loaded (`servetwin.experiments.validate.published.load_published`); the conversions are in `token_basis`."""
from __future__ import annotations

import math
from typing import Any, Mapping

# out_tok_s / req_s must give the recorded client count to this relative tolerance (the reports' rounding)
RATIO_TOLERANCE = 1e-3


def check_token_basis(name: str, entry: Mapping[str, Any]) -> None:
    """published.json `NAME.token_basis`: {client_tokens_per_request, source} for the whole-run figures,
    `per_stage: [{rate, client_tokens_per_request, source}]` for staged ones, or `not_converted: why`. A count
    must agree with out_tok_s / req_s where the same figures publish both."""
    basis = entry.get("token_basis")
    if basis is None:
        return
    where = f"published.json.{name}.token_basis"
    if not isinstance(basis, Mapping):
        raise ValueError(f"{where}: must be a mapping")
    unknown = sorted(set(basis) - {"client_tokens_per_request", "source", "per_stage", "not_converted", "reference"})
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}")
    if "client_tokens_per_request" in basis:
        _check_count(where, basis, entry.get("published") or {})
    if not isinstance(basis.get("per_stage") or [], list):
        raise ValueError(f"{where}.per_stage: must be a list of {{rate, client_tokens_per_request, source}}")
    stages = {float(st["rate"]): st for st in ((entry.get("stages") or {}).get("per_stage") or [])}
    for i, st in enumerate(basis.get("per_stage") or []):
        at = f"{where}.per_stage[{i}]"
        if not isinstance(st, Mapping) or "rate" not in st or float(st["rate"]) not in stages:
            raise ValueError(f"{at}: must name the `rate` of a published stage")
        _check_count(at, st, stages[float(st["rate"])])
    if "client_tokens_per_request" not in basis and not basis.get("per_stage") and not basis.get("not_converted"):
        raise ValueError(f"{where}: give client_tokens_per_request, per_stage or not_converted (why)")


def _check_count(where: str, basis: Mapping[str, Any], figures: Mapping[str, Any]) -> None:
    count = basis.get("client_tokens_per_request")
    if isinstance(count, bool) or not isinstance(count, (int, float)) or not math.isfinite(count) or count <= 0:
        raise ValueError(f"{where}.client_tokens_per_request: must be a positive number")
    if not isinstance(basis.get("source"), str) or not basis["source"].strip():
        raise ValueError(f"{where}.source: must say which published figures give the count")
    if "out_tok_s" in figures and figures.get("req_s"):
        ratio = float(figures["out_tok_s"]) / float(figures["req_s"])
        if abs(count - ratio) > RATIO_TOLERANCE * ratio:
            raise ValueError(f"{where}.client_tokens_per_request: {count:g} but the same figures' out_tok_s / "
                             f"req_s is {ratio:.6g}")
