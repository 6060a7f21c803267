"""The `servetwin` command line: replay, run, sweep, compare, calibrate, serve."""
from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys


def _cmd_replay(args: argparse.Namespace) -> int:
    from servetwin.core.testbed.atomic import atomic_open
    from servetwin.core.testbed.replay import replay_jsonl, write_replay
    from servetwin.core.testbed.scenario import load_scenario
    from servetwin.experiments.config.schema import ensure_output_file

    if args.max_output_bytes < 0:
        raise ValueError(f"--max-output-bytes: must be >= 0 (0: no limit), got {args.max_output_bytes}")
    scenario = load_scenario(args.scenario)
    if args.output in (None, "-"):
        # the whole replay first (a rejected scenario prints nothing), within the output bound
        lines = list(replay_jsonl(scenario, args.max_output_bytes))
        sys.stdout.writelines(lines)
        return 0
    ensure_output_file(args.output)
    # Written under a temporary name and renamed when complete: a scenario rejected mid-replay
    # (an unservable request) or a Ctrl-C leaves no file, and an existing one untouched.
    with atomic_open(args.output) as f:
        n = write_replay(scenario, f, args.max_output_bytes)
    print(f"wrote {n} lines to {args.output}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="servetwin", description="vLLM-v1-style serving testbed: "
                                "one scheduler, a simulator and a real torch backend.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("replay", help="replay a scenario JSON through the shared scheduler (fake sampler)")
    r.add_argument("scenario", help="scenario JSON file (settings + requests)")
    r.add_argument("-o", "--output", help="output JSONL (default: stdout)")
    r.add_argument("--max-output-bytes", type=int, default=1 << 30,
                   help="stop with an error once the output passes this many bytes (default 1 GiB; 0: no limit)")
    r.set_defaults(func=_cmd_replay)
    for register in _extra_commands():
        register(sub)
    return p


def _extra_commands():
    """Commands living in other modules, registered only if their module imports."""
    import importlib

    out = []
    for mod in ("servetwin.experiments.run.run_cli", "servetwin.experiments.capacity.capacity_cli",
                "servetwin.experiments.compare.compare_cli", "servetwin.experiments.serve.serve_cli",
                "servetwin.experiments.validate.validate_cli", "servetwin.experiments.presets.presets_cli",
                "servetwin.experiments.vllm_import.import_cli"):
        try:
            out.append(importlib.import_module(mod).register)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
    return out


class Terminated(KeyboardInterrupt):
    """SIGTERM, turned into an interrupt: the same clean-up as Ctrl-C (temporary files removed, a run
    folder marked interrupted), then exit status 143 (128 + 15)."""


_MAIN_PID = os.getpid()


def _terminate(signum: int, frame: object) -> None:
    if os.getpid() != _MAIN_PID:  # a forked child inherited the handler: die by the signal as usual
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    raise Terminated()


def _leave_the_heap_to_the_os() -> None:
    """At interpreter exit (an atexit hook: every command has returned, its files are closed): whatever
    is still alive is frozen out of the last collections (`gc.freeze`) and left to the OS. A run's
    simulation leaves millions of objects in reference cycles; collecting them at exit took ~0.6 s of
    the 16-engine routing ladder's run, to free memory the process gives back the next moment."""
    import gc  # noqa: PLC0415

    gc.freeze()


def main(argv: list[str] | None = None) -> int:
    atexit.unregister(_leave_the_heap_to_the_os)  # once, however often main runs in one process
    atexit.register(_leave_the_heap_to_the_os)
    args = build_parser().parse_args(argv)
    if isinstance(getattr(args, "output", None), str):
        args.output = os.path.expanduser(args.output)  # `-o '~/x'`, quoted, reaches us unexpanded
    previous = signal.signal(signal.SIGTERM, _terminate) if _main_thread() else None
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
        from servetwin.sim.cluster_parallel import WorkerFailed  # noqa: PLC0415

        if not isinstance(e, (EngineStartupError, WorkerFailed)):  # (a process that failed: its own words)
            raise
        print(f"servetwin {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        terminated = isinstance(e, Terminated)
        print(f"servetwin {args.command}: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
        return 143 if terminated else 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main_thread() -> bool:
    import threading  # noqa: PLC0415

    return threading.current_thread() is threading.main_thread()


def _message(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror and e.filename is not None:
        return f"{e.filename}: {e.strerror}"  # not "[Errno 20] Not a directory: ..."
    return str(e)


if __name__ == "__main__":
    sys.exit(main())
