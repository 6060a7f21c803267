"""`servetwin compare` and `servetwin calibrate` (registered by `servetwin.experiments.cli`)."""
from __future__ import annotations

import argparse
import os
import sys
import time


def _cmd_compare(args: argparse.Namespace) -> int:
    if args.measured:  # a profiler trace of a run elsewhere (vLLM, servetwin): servetwin.experiments.vllm_import
        from servetwin.experiments.vllm_import.trace_cli import cmd_compare_measured  # noqa: PLC0415

        return cmd_compare_measured(args)
    if args.config is None:
        raise ValueError("config: the experiment YAML is required")
    from servetwin.experiments.compare.compare import CompositionMismatch, compare, load_compare_config  # noqa: PLC0415
    from servetwin.experiments.run.run_folder import RunFolder  # noqa: PLC0415

    exp = load_compare_config(args.config, calibration=args.calibration, overrides=args.overrides,
                              requests=args.requests)
    out = args.output or os.path.join("runs", f"compare-{exp.name}")
    t0 = time.perf_counter()
    with RunFolder(out, overwrite=args.overwrite) as folder:
        try:
            res = compare(exp, out, repeats=args.repeats, threads=args.threads, plots=not args.no_plots,
                          config_path=os.path.abspath(args.config), retry_contended=args.retry_contended,
                          max_contended_share=args.max_contended_share, folder=folder)
        except CompositionMismatch as e:
            print(f"servetwin compare: FAILED: {e}", file=sys.stderr)
            print(f"servetwin compare: wrote {out}/: {folder.describe()}", file=sys.stderr)
            return 1
    s = res["step_abs_pct_error"]
    line = (f"{res['mode']}: {res['steps']} steps, per-step |error| p50 {s['p50']:.2f}% p90 {s['p90']:.2f}%, "
            f"makespan {res['makespan_signed_pct_error']:+.2f}%")
    if res["e2e_pct_error"]["p50"] is not None:
        line += f", E2E p50 {res['e2e_signed_pct_error']['p50']:+.2f}%"
    otp = res.get("output_throughput_tok_s") or {}
    if otp.get("predicted") is not None and otp.get("measured") is not None:
        line += f", output throughput {otp['predicted']:,.0f} predicted vs {otp['measured']:,.0f} measured tok/s"
    if res["mode"] == "online":
        line += f", identical steps {res['identical_step_share'] * 100:.1f}%"
    noise = res.get("noise") or {}
    if noise.get("step_abs_pct_error"):
        line += f" (noise: per-step p50 {noise['step_abs_pct_error']['p50']:.2f}%)"
    print(line)
    print(f"wrote {out}/: {folder.describe()} in {time.perf_counter() - t0:.1f}s")
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from servetwin.experiments.calibrate.calibrate import calibrate  # noqa: PLC0415
    from servetwin.experiments.config.schema import check_output_file, ensure_output_dir, ensure_output_file  # noqa: PLC0415

    if args.from_vllm:  # fit on vLLM's files instead of measuring: servetwin.experiments.vllm_import
        from servetwin.experiments.vllm_import.calibrate_cli import cmd_calibrate_from_vllm  # noqa: PLC0415

        return cmd_calibrate_from_vllm(args)
    if not args.model:
        raise ValueError("--model: required (the model the torch backend measures)")

    if args.backend != "torch":
        raise ValueError(f"--backend: only 'torch' is measured, got {args.backend!r}")
    for flag, value, low in (("--repeats", args.repeats, 1), ("--threads", args.threads, 1)):
        if value is not None and value < low:
            raise ValueError(f"{flag}: must be >= {low}, got {value}")
    if not args.no_trim and not args.trim > 0:
        raise ValueError(f"--trim: must be > 0, got {args.trim} (--no-trim keeps every sample)")
    check_output_file(args.output)  # before minutes of measuring, not after
    ensure_output_dir(os.path.dirname(os.path.abspath(args.output)))
    ensure_output_file(args.output)
    if args.trace_dir:
        ensure_output_dir(args.trace_dir, "--trace-dir")
    calibrate(args.model, args.output, device=args.device, dtype=args.dtype, threads=args.threads,
              design=args.design, repeats=args.repeats, base=args.base, weighting=args.weighting,
              trim=None if args.no_trim else args.trim, from_run=args.from_run, trace_dir=args.trace_dir,
              enforce_eager=args.enforce_eager, attention_backend=args.attention_backend, seed=args.seed,
              gemm_curve=not args.no_gemm_curve)
    print(f"wrote {args.output}")
    return 0


def register(subparsers) -> None:
    c = subparsers.add_parser(
        "compare", help="run a workload on the simulator and the torch backend; score predicted vs measured",
        description="Run one experiment config on both backends (same requests, engine settings, KV pool and "
                    "dtype) and write comparison.json, comparison.md, plots and the trace tables. Offline "
                    "workloads must schedule identical steps on both backends (else exit status 1, naming the "
                    "first differing step); online workloads (Poisson etc. arrivals, in wall time on torch) "
                    "report how many steps stayed identical.")
    c.add_argument("config", nargs="?", help="experiment YAML (e.g. experiments/configs/compare_smollm2_offline.yaml)")
    c.add_argument("-o", "--output", help="output folder (default: runs/compare-<name>)")
    c.add_argument("--calibration", metavar="FILE",
                   help="calibration YAML (from `servetwin calibrate`) used as the simulator's hardware; "
                        "default: the config's `hardware:`")
    c.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="measured torch runs (default 1); with N >= 2 the machine noise (measured vs measured) "
                        "is reported next to the model error")
    c.add_argument("--threads", type=int, metavar="N",
                   help="torch CPU threads (default: the calibration's `torch_threads`, else torch's default)")
    c.add_argument("--retry-contended", type=int, default=2, metavar="K",
                   help="run a measured repeat again (at most K times in all) when more than "
                        "--max-contended-share of its steps lost their CPU to other processes (or to a "
                        "hypervisor's steal); discarded attempts are listed in comparison.json (default 2; "
                        "0 keeps every repeat)")
    c.add_argument("--max-contended-share", type=float, default=0.05, metavar="F",
                   help="share of contended steps that makes a repeat contended (default 0.05)")
    c.add_argument("--requests", type=int, metavar="N", help="override the number of requests")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field by dotted path (repeatable)")
    c.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    c.add_argument("--measured", nargs="+", metavar="TRACE",
                   help="compare the simulator with these profiler traces (vLLM's Chrome traces, one per rank) "
                        "instead of running the torch backend: predicted vs measured step time by phase")
    c.add_argument("--overwrite", action="store_true",
                   help="replace the contents of a non-empty output folder (default: refuse it)")
    c.set_defaults(func=_cmd_compare)

    k = subparsers.add_parser(
        "calibrate", help="measure designed steps on the real backend and fit the cost model's coefficients",
        description="Run a designed set of engine steps (pure prefills over chunk sizes and cached-prefix "
                    "lengths, pure decodes over batch sizes x KV lengths, mixed steps, each repeated after a "
                    "warm-up) through the real EngineCore, fit the cost model's coefficients by non-negative "
                    "least squares, and write a hardware YAML with the coefficients and their provenance "
                    "(usable as `hardware:` in an experiment or `servetwin compare --calibration`).")
    k.add_argument("--model", help="model name the torch loader knows (e.g. smollm2-135m); required unless --from-vllm")
    k.add_argument("--backend", default="torch", choices=["torch"], help="measured backend (torch)")
    k.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (default cpu)")
    k.add_argument("--dtype", default="auto", help="model dtype (default auto: float32 on the CPU)")
    k.add_argument("--threads", type=int, default=1, metavar="N",
                   help="torch CPU threads (default 1: stable timings on a shared machine); recorded")
    k.add_argument("--design", default="default", help="step design: default (~1-3 min for smollm2-135m on 2 "
                   "CPU cores) or quick (seconds on tiny-llama)")
    k.add_argument("--repeats", type=int, metavar="N", help="repeats of every designed case (default: the design's)")
    k.add_argument("--base", help="hardware preset the file starts from (default: cpu, or the CUDA device's preset)")
    k.add_argument("--weighting", default="relative", choices=["relative", "absolute"],
                   help="least-squares weighting (default relative: minimises per-step percentage error)")
    k.add_argument("--trim", type=float, default=4.0, metavar="K",
                   help="drop samples whose relative residual is > K robust SDs from the median, refit (default 4)")
    k.add_argument("--no-trim", action="store_true", help="fit on every sample")
    k.add_argument("--from-run", metavar="DIR",
                   help="fit on an existing run's torch trace (DIR/torch/*.parquet) instead of measuring")
    k.add_argument("--trace-dir", metavar="DIR", help="also write the measured steps as trace tables here")
    k.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (CUDA only)")
    k.add_argument("--no-gemm-curve", action="store_true",
                   help="on a CPU, do not time the layer GEMMs per token count (efficiency.gemm_m_curve): fit "
                        "on the base preset's smooth GEMM efficiency instead")
    k.add_argument("--attention-backend", default="auto", help="auto | torch-paged | flash-attn")
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("-o", "--output", required=True, help="calibration YAML to write")
    k.add_argument("--from-vllm", nargs="+", metavar="FILE",
                   help="fit on vLLM's files instead of measuring: profiler traces (with --experiment) and/or "
                        "`vllm bench serve` results; starts from --hardware's preset")
    k.add_argument("--experiment", action="append", default=[], metavar="YAML",
                   help="with --from-vllm traces: the measured run's experiment (one, or one per trace)")
    k.add_argument("--hardware", help="with --from-vllm: the GPU (a preset or a GPU name) the files come from")
    k.add_argument("--tensor-parallel-size", type=int, help="with --from-vllm bench files: the server's TP size")
    k.add_argument("--rounds", type=int, default=1, help="with --from-vllm bench files: search rounds (default 1)")
    k.add_argument("--engine", action="append", metavar="KEY=VALUE",
                   help="with --from-vllm bench files: an engine setting of the server, as `import vllm-bench "
                        "--engine` (e.g. quantization=fp8); repeatable")
    k.add_argument("--vllm-version", help="with --from-vllm bench files: the server's vLLM version (default: the "
                                          "file name's, e.g. vllm0.6.3)")
    k.set_defaults(func=_cmd_calibrate)
