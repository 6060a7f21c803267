"""`servetwin import vllm-bench|vllm-log|vllm-trace` (registered by `servetwin.experiments.cli`)."""
from __future__ import annotations

import argparse
import sys
from typing import Optional


def _log(msg: str) -> None:
    print(msg, file=sys.stderr)


def import_options(opts, engine_flags: Optional[list[str]]):
    """`opts` with the server's `--engine KEY=VALUE` flags (a result file cannot record them:
    quantization, max_num_seqs, ...) - shared by `import vllm-bench` and `calibrate --from-vllm`."""
    import yaml  # noqa: PLC0415

    for text in engine_flags or []:
        key, sep, value = text.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--engine: expected KEY=VALUE (a vLLM engine argument), got {text!r}")
        opts.engine[key.strip()] = yaml.safe_load(value)
        opts.engine_sources[key.strip()] = f"{value} from --engine"
    return opts


def _options(args: argparse.Namespace):
    from servetwin.experiments.vllm_import.bench_case import ImportOptions  # noqa: PLC0415

    opts = import_options(ImportOptions(model=args.model, hardware=args.hardware,
                                        tensor_parallel_size=args.tensor_parallel_size,
                                        vllm_version=args.vllm_version, num_prompts=args.num_prompts,
                                        input_len=args.input_len, output_len=args.output_len, name=args.name),
                          args.engine)
    if args.server_log:
        from servetwin.experiments.vllm_import.server_log import apply_to_options, read_server_log  # noqa: PLC0415

        apply_to_options(read_server_log(args.server_log), opts, args.server_log)
    return opts


def _cmd_bench(args: argparse.Namespace) -> int:
    from servetwin.experiments.vllm_import.bench_case import build_case, import_cases  # noqa: PLC0415
    from servetwin.experiments.vllm_import.bench_file import load_bench_file  # noqa: PLC0415

    for flag in ("tensor_parallel_size", "num_prompts", "input_len", "output_len"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')}: must be >= 1, got {value}")
    opts = _options(args)
    records = [r for path in args.files for r in load_bench_file(path)]
    if args.name and len(records) > 1:
        raise ValueError(f"--name: {len(records)} records imported; --name names one")
    cases = [build_case(r, opts) for r in records]  # every record checked before anything is written
    import_cases(cases, args.output, overwrite=args.overwrite, log=_log)
    print(f"imported {len(cases)} case(s) into {args.output}; run: servetwin validate {args.output}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("import", help="import vLLM benchmark results, server logs and profiler traces")
    sub = p.add_subparsers(dest="what", required=True)
    b = sub.add_parser("vllm-bench", help="`vllm bench serve --save-result` JSON (or SGLang bench_serving JSONL, "
                                          "InferenceMAX) -> a `servetwin validate` case directory",
                       description="Writes DIR/cases/NAME.yaml (an experiment mirroring the run), DIR/published.json "
                                   "(the file's figures) and, for --save-detailed results, NAME.requests.csv with "
                                   "the exact request lengths in order. Then: servetwin validate DIR.")
    b.add_argument("files", nargs="+", help="result files (.json, or .jsonl with one run per line)")
    b.add_argument("-o", "--output", required=True, help="case directory to write (added to if it exists)")
    b.add_argument("--model", help="model (the file's model_id is often a local path)")
    b.add_argument("--hardware", help="hardware preset or YAML (no result file records the GPU)")
    b.add_argument("--tensor-parallel-size", "-tp", type=int, help="tensor parallel size of the server")
    b.add_argument("--vllm-version", help="the server's vLLM version (e.g. 0.11.0): its scheduler settings apply")
    b.add_argument("--server-log", help="the vLLM server's log: version, TP, KV blocks, engine arguments")
    b.add_argument("--engine", action="append", metavar="KEY=VALUE",
                   help="an engine setting of the server (vLLM's name, e.g. quantization=fp8, max_num_seqs=256); "
                        "repeatable; checked when the case runs")
    b.add_argument("--num-prompts", type=int, help="request count, for files without one")
    b.add_argument("--input-len", type=int, help="prompt tokens per request, for files without token totals")
    b.add_argument("--output-len", type=int, help="output tokens per request, for files without token totals")
    b.add_argument("--name", help="case name (default: the file's stem)")
    b.add_argument("--overwrite", action="store_true", help="replace a case of the same name")
    b.set_defaults(func=_cmd_bench)
    from servetwin.experiments.vllm_import import server_log, trace_cli  # noqa: PLC0415

    trace_cli.register(sub)
    server_log.register(sub)
