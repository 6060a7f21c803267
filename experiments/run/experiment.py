"""`run_experiment` for any experiment: one engine (`servetwin.experiments.run.runner`) or a cluster
(`servetwin.experiments.run.cluster_run`), chosen by the config's `cluster:` section."""
from __future__ import annotations

from typing import Any, Callable, Optional

from servetwin.experiments.config.schema import ExperimentConfig
from servetwin.experiments.run import runner
from servetwin.experiments.run.run_folder import RunFolder


def run_experiment(exp: ExperimentConfig, out_dir: str, progress: bool = True,
                   log: Optional[Callable[[str], None]] = None, overwrite: bool = False,
                   folder: Optional[RunFolder] = None, measure: Any = None) -> dict[str, Any]:
    """`runner.run_experiment`'s contract; a cluster runs through `cluster_run.run_cluster_experiment`."""
    if exp.cluster is None:
        return runner.run_experiment(exp, out_dir, progress, log, overwrite, folder, measure)
    from servetwin.experiments.run.cluster_run import run_cluster_experiment  # noqa: PLC0415

    if folder is None:
        with RunFolder(out_dir, overwrite=overwrite) as owned:
            return run_cluster_experiment(exp, out_dir, owned, progress, log)
    return run_cluster_experiment(exp, out_dir, folder, progress, log)


def run_summary(exp: ExperimentConfig, log: Optional[Callable[[str], None]] = None) -> dict[str, Any]:
    """The combined summary of `run_experiment`, nothing written (a capacity probe): `combined["interrupted"]`
    set where Ctrl-C stopped it."""
    if exp.cluster is None:
        return runner.run_backends(exp, progress=False, log=log)[0]
    from servetwin.experiments.run.cluster_run import cluster_run_summary  # noqa: PLC0415

    return cluster_run_summary(exp)


__all__ = ["run_experiment", "run_summary"]
