"""`servetwin calibrate --from-vllm FILES... -o my_gpu.yaml` (the flags live on `servetwin calibrate`)."""
from __future__ import annotations

import argparse
import sys


def cmd_calibrate_from_vllm(args: argparse.Namespace) -> int:
    from servetwin.experiments.config.schema import check_output_file, ensure_output_file  # noqa: PLC0415
    from servetwin.experiments.vllm_import.bench_case import ImportOptions  # noqa: PLC0415
    from servetwin.experiments.vllm_import.fit_check import FitFailed  # noqa: PLC0415
    from servetwin.experiments.vllm_import.from_vllm import calibrate_from_vllm  # noqa: PLC0415
    from servetwin.experiments.vllm_import.import_cli import import_options  # noqa: PLC0415

    if args.rounds < 1:
        raise ValueError(f"--rounds: must be >= 1, got {args.rounds}")
    check_output_file(args.output)
    ensure_output_file(args.output)
    opts = import_options(ImportOptions(model=args.model, tensor_parallel_size=args.tensor_parallel_size,
                                         vllm_version=args.vllm_version), args.engine)
    try:
        doc = calibrate_from_vllm(args.from_vllm, args.output, hardware=args.hardware, experiments=args.experiment,
                                  opts=opts, trim=None if args.no_trim else args.trim, rounds=args.rounds,
                                  log=lambda m: print(m, file=sys.stderr))
    except FitFailed as e:
        print(f"servetwin calibrate: error: {e}", file=sys.stderr)
        return 1
    prov = doc["provenance"]
    for key, stat, what in (("step_errors", "median_abs_rel_err", "per-step median |error|"),
                            ("bench_errors", "mean_abs_log_err", "mean |log(predicted / published)|"),
                            ("bench_check", "mean_abs_log_err", "mean |log(predicted / published)|")):
        for part in ("in_sample", "leave_one_file_out"):
            for label, e in (prov.get(key, {}).get(part) or {}).items():
                print(f"{part} {label}: {what} {100 * e[stat]:.2f}%")
    print(f"wrote {args.output}")
    return 0
