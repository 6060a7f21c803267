"""The `servetwin` command line: replay, run, sweep, compare, calibrate, serve."""
from __future__ import annotations

import argparse
import sys


def _cmd_replay(args: argparse.Namespace) -> int:
    from core.replay import write_replay
    from core.scenario import load_scenario

    scenario = load_scenario(args.scenario)
    if args.output in (None, "-"):
        write_replay(scenario, sys.stdout)
    else:
        with open(args.output, "w") as f:
            n = write_replay(scenario, f)
        print(f"wrote {n} lines to {args.output}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="servetwin", description="vLLM-v1-style serving testbed: "
                                "one scheduler, a simulator and a real torch backend.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("replay", help="replay a scenario JSON through the shared scheduler (fake sampler)")
    r.add_argument("scenario", help="scenario JSON file (settings + requests)")
    r.add_argument("-o", "--output", help="output JSONL (default: stdout)")
    r.set_defaults(func=_cmd_replay)
    for register in _extra_commands():
        register(sub)
    return p


def _extra_commands():
    """Commands living in other modules, registered only if their module imports."""
    import importlib

    out = []
    for mod in ("experiments.run_cli", "experiments.compare_cli", "experiments.serve_cli"):
        try:
            out.append(importlib.import_module(mod).register)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"servetwin {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"servetwin {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
