"""The run folder of `servetwin capacity` on a cluster config, as the load search writes its own: config.yaml,
probes.csv (every deployment simulated: its instances, router, GPUs, whether it met the SLOs and each SLO's
value), capacity.md (the ranked table, the cheapest and the runner-up) and capacity.json, written last: a folder
without it is incomplete; `"interrupted": true` where Ctrl-C stopped the search (the probes that ran are kept)."""
from __future__ import annotations

import math
from typing import Any, Optional

from servetwin.experiments.capacity.deployments import checks_pass, render, worst_text


def probe_row(exp: Any, checks: list[dict[str, Any]]) -> dict[str, Any]:
    """One simulated deployment (`exp`, its config) and its SLO checks, as a probes.csv row."""
    base_tp = exp.engine.args.tensor_parallel_size
    parts = []
    for inst in exp.cluster.instances:
        tp = int(inst.engine.get("tensor_parallel_size", base_tp))
        dp = f", DP{inst.data_parallel_size}" if inst.data_parallel_size > 1 else ""
        role = "" if inst.role == "both" else f" {inst.role}"
        parts.append(f"{inst.count} x {inst.name}{role} (TP{tp}{dp})")
    row: dict[str, Any] = {"deployment": " + ".join(parts), "router": exp.cluster.router.type,
                           "gpus": exp.cluster.num_gpus(base_tp), "passed": checks_pass(checks),
                           "worst": worst_text(checks)}
    for c in checks:
        if c.get("kind") != "deadline":  # (a deadline's share is in the attainment check)
            row[c["name"]] = c["value"]
    return row


def _finite(x: Optional[float]) -> Optional[float]:
    return x if x is not None and math.isfinite(x) else None


def deployments_answer(exp: Any, slo: dict[str, Any], results: Optional[list[Any]], probes: list[dict[str, Any]],
                       interrupted: bool) -> dict[str, Any]:
    """capacity.json: the deployments ranked (cheapest first; None where the search was interrupted)."""
    ranked = [{"rank": i, "kind": r.kind, "tp": r.tp_text, "router": r.router, "instances": r.instances_text,
               "gpus": r.gpus, "deployment": r.label if r.gpus else None,
               "worst_slo_ratio": _finite(r.worst_ratio()), "binds": r.binds()}
              for i, r in enumerate(results or [], 1)]
    ok = [d for d in ranked if d["gpus"]]
    return {"name": exp.name, "search": "deployments", "slo": slo, "interrupted": interrupted,
            "cheapest": ok[0] if ok else None, "runner_up": ok[1] if len(ok) > 1 else None,
            "deployments": ranked if results is not None else None, "probes": len(probes)}


def deployments_markdown(answer: dict[str, Any], results: Optional[list[Any]]) -> str:
    slo = ", ".join(f"`{k}` {v:g}" if isinstance(v, (int, float)) else f"`{k}` {v}" for k, v in answer["slo"].items())
    lines = [f"# Capacity across deployments: {answer['name']}", "",
             f"The cheapest deployment (GPUs) serving the config's own load under {slo or 'the config SLOs'}; "
             "one simulation per deployment probed (docs/capacity.md, \"Across deployments\"). "
             f"{answer['probes']} deployments simulated: probes.csv.", ""]
    if answer["interrupted"]:
        lines += ["**Interrupted (Ctrl-C): the search did not finish; probes.csv has the deployments simulated "
                  "before it stopped, and no ranking is given.**", ""]
    if results is not None:
        lines += render(results)
    return "\n".join(lines) + "\n"


def write_deployments(folder: Any, exp: Any, slo: dict[str, Any], results: Optional[list[Any]],
                      probes: list[dict[str, Any]], interrupted: bool) -> dict[str, Any]:
    """config.yaml, probes.csv, capacity.md, then capacity.json (each renamed into place complete)."""
    import pandas as pd  # noqa: PLC0415
    import yaml  # noqa: PLC0415

    from servetwin.experiments.run.report import portable_config  # noqa: PLC0415

    answer = deployments_answer(exp, slo, results, probes, interrupted)
    folder.write_text("config.yaml", yaml.safe_dump(portable_config(exp.to_dict(), folder.path), sort_keys=False))
    frame = pd.DataFrame(probes)
    folder.write_with("probes.csv", lambda tmp: frame.to_csv(tmp, index=False))
    folder.write_text("capacity.md", deployments_markdown(answer, results))
    folder.write_json("capacity.json", answer)  # last: its presence and "interrupted" are the truth
    return answer


__all__ = ["probe_row", "deployments_answer", "deployments_markdown", "write_deployments"]
