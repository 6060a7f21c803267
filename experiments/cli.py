"""The `servetwin` command line: replay, run, sweep, compare, calibrate, serve."""
from __future__ import annotations

import argparse
import json
import sys


def _cmd_replay(args: argparse.Namespace) -> int:
    from servetwin.core.testbed.atomic import atomic_open
    from servetwin.core.testbed.replay import replay, write_replay
    from servetwin.core.testbed.scenario import load_scenario
    from servetwin.experiments.schema import ensure_output_file

    scenario = load_scenario(args.scenario)
    if args.output in (None, "-"):
        lines = list(replay(scenario))  # the whole replay first: a rejected scenario prints nothing
        for line in lines:
            sys.stdout.write(json.dumps(line) + "\n")
        return 0
    ensure_output_file(args.output)
    # Written under a temporary name and renamed when complete: a scenario rejected mid-replay
    # (an unservable request) or a Ctrl-C leaves no file, and an existing one untouched.
    with atomic_open(args.output) as f:
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
    for mod in ("servetwin.experiments.run_cli", "servetwin.experiments.capacity_cli",
                "servetwin.experiments.compare_cli", "servetwin.experiments.serve_cli",
                "servetwin.experiments.validate_cli", "servetwin.experiments.presets_cli",
                "servetwin.experiments.vllm_import.import_cli"):
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
    except (ValueError, FileNotFoundError) as e:  # bad input: a field, a file or a model that is not there
        print(f"servetwin {args.command}: error: {_message(e)}", file=sys.stderr)
        return 2
    except OSError as e:  # an output that cannot be written (permissions, disk full, ...)
        print(f"servetwin {args.command}: error: {_message(e)}", file=sys.stderr)
        return 1
    except RuntimeError as e:
        from servetwin.core.engine.mp_client import EngineStartupError  # noqa: PLC0415

        if not isinstance(e, EngineStartupError):
            raise
        print(f"servetwin {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"servetwin {args.command}: interrupted", file=sys.stderr)
        return 130


def _message(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror and e.filename is not None:
        return f"{e.filename}: {e.strerror}"  # not "[Errno 20] Not a directory: ..."
    return str(e)


if __name__ == "__main__":
    sys.exit(main())
