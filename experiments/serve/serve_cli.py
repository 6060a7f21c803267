"""`servetwin serve`: the OpenAI-compatible server (`servetwin.core.entrypoints.openai.api_server`).

    servetwin serve --model tiny-llama --backend torch --port 8000
    servetwin serve --model llama-3.1-8b --backend sim --hardware h100-sxm --time-scale 0.1

Every `EngineArgs` field is an option (`--max-num-seqs 64`, `--no-enable-prefix-caching`, ...).
With `--backend sim` the engine is paced: outputs are released when simulated time reaches each
step's predicted end (`--time-scale` wall seconds per simulated second; `--no-pace` turns it off).
With the `fake` and `sim` backends the text side uses the built-in toy tokenizer unless
`--tokenizer` / `--skip-tokenizer-init` is given.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import MISSING, fields
from typing import Any

OWN_ARGS = {"model", "backend", "multiprocess"}


def _arg_type(field: Any) -> Any:
    ann = str(field.type)
    for name, typ in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if ann == name or ann == f"Optional[{name}]" or ann.startswith(f"{name} |") or ann.endswith(f"| {name}"):
            return typ
    return str


def register(subparsers: Any) -> None:
    from servetwin.core.engine.engine_args import ENGINE_ARG_ALIASES, FIELD_HELP, EngineArgs  # noqa: PLC0415

    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, /metrics)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="EXPERIMENT.yaml",
                   help="take model, hardware, seed and engine arguments from an experiment YAML (parsed as "
                        "`servetwin run` parses it); options given here override them")
    p.add_argument("--model", default=None, help="model name or path (default: the config's, else tiny-llama)")
    p.add_argument("--backend", choices=["torch", "sim", "fake"], default=None,
                   help="executor (default: the config's first backend, else torch)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument("--served-model-name", default=None, help="model name in the API (default: --model)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="paced mode: wall seconds per simulated second (default 1.0; 0.1 = 10x faster)")
    p.add_argument("--pace", action=argparse.BooleanOptionalAction, default=None,
                   help="release outputs at the predicted step end times (default: on for --backend sim)")
    p.add_argument("--fake-step-time", type=float, default=None,
                   help="fake backend: constant step duration in seconds (paced like sim when --pace)")
    p.add_argument("--max-request-bytes", type=int, default=None,
                   help="largest request body in bytes; larger ones get a 413 before they are read "
                        "(default 4 MiB = 4194304; 0: no limit)")
    p.add_argument("--max-seqs-per-request", type=int, default=None,
                   help="most sequences one request may create, prompts x n (default 256)")
    p.add_argument("--max-header-bytes", type=int, default=None,
                   help="largest request line + headers in bytes; larger: a 431 (default 65536)")
    p.add_argument("--max-header-count", type=int, default=None,
                   help="most headers in one request; more: a 431 (default 256, vLLM's --h11-max-header-count)")
    p.add_argument("--read-timeout", type=float, default=None,
                   help="seconds for a request's headers and body to arrive; slower: a 408 and the connection "
                        "is closed (default 30; 0: no deadline)")
    p.add_argument("--timeout-keep-alive", type=float, default=None,
                   help="seconds an idle keep-alive connection is kept (default 5, uvicorn's and vLLM's)")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer <key>` on /v1/* (default: $SERVETWIN_API_KEY; none: open)")
    # vLLM's spelling (VLLM_TORCH_PROFILER_DIR, --profiler-config's torch_profiler_dir); --profile-dir, the
    # engine argument's name, is the same flag here: serve profiles between the endpoints only, as vLLM does
    p.add_argument("--profiler-dir", "--profile-dir", dest="profiler_dir", default=None, metavar="DIR",
                   help="enable vLLM's POST /start_profile and /stop_profile, writing the steps in between here as a "
                        "Chrome trace (torch: torch.profiler; sim: the predicted steps); default "
                        "$VLLM_TORCH_PROFILER_DIR (--profile-dir: the same flag)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    eng = p.add_argument_group("engine arguments (vLLM names)")
    for f in fields(EngineArgs):
        if f.name in OWN_ARGS or f.name in ("num_gpu_blocks", "profile_dir"):  # one flag for both names, vLLM's first
            continue
        flags = ["--" + f.name.replace("_", "-")]
        if f.name == "num_gpu_blocks_override":
            flags.append("--num-gpu-blocks")
        default = None if f.default is MISSING else f.default
        text = FIELD_HELP[f.name]
        if default is not None and "default" not in text:
            text += f" (default: {default})"
        _add_engine_flag(eng, flags, f.name, _arg_type(f), text)
    for alias, name in ENGINE_ARG_ALIASES.items():  # vLLM's spelling: its own dest, so both given is an error
        _add_engine_flag(eng, ["--" + alias.replace("_", "-")], alias, str, f"the same as --{name.replace('_', '-')}"
                         " (vLLM's name; give one of the two)")
    p.set_defaults(func=_cmd_serve)


def _add_engine_flag(group: Any, flags: list[str], name: str, typ: Any, text: str) -> None:
    from servetwin.core.engine.engine_args import ENGINE_ARG_ALIASES, FIELD_CHOICES  # noqa: PLC0415

    if typ is bool:
        group.add_argument(*flags, dest=f"engine_{name}", action=argparse.BooleanOptionalAction, default=None,
                           help=text)
        return
    choices = FIELD_CHOICES.get(ENGINE_ARG_ALIASES.get(name, name))  # shown as {a,b} in place of a metavar
    metavar = None if choices else "N" if typ is int else "X" if typ is float else name.upper()
    group.add_argument(*flags, dest=f"engine_{name}", type=typ, default=None, metavar=metavar, choices=choices,
                       help=text)


def engine_args_from(ns: argparse.Namespace) -> Any:
    from servetwin.core.engine.engine_args import EngineArgs, apply_batch_defaults, resolve_aliases  # noqa: PLC0415

    # vLLM's alias names resolved among the flags first (both flags: an error); the config's values are ours
    kwargs = resolve_aliases({k[len("engine_"):]: v for k, v in vars(ns).items()
                              if k.startswith("engine_") and v is not None})
    base: dict[str, Any] = {}
    backend = ns.backend
    if getattr(ns, "config", None):
        from servetwin.experiments.config.schema import BACKENDS, load_config  # noqa: PLC0415

        exp = load_config(ns.config, values={"backends": [backend]} if backend in BACKENDS else None)
        backend = backend or exp.backends[0]
        args = exp.engine_args(backend)
        base = {f.name: getattr(args, f.name) for f in fields(args)}
    backend = backend or "torch"
    model = ns.model or base.pop("model", None) or "tiny-llama"
    base.pop("model", None)
    kwargs = {**base, **kwargs}
    if backend in ("fake", "sim") and kwargs.get("tokenizer") is None and not kwargs.get("skip_tokenizer_init"):
        kwargs["tokenizer"] = "toy"
        import sys  # noqa: PLC0415

        print(f"note: the {backend} backend counts text with the toy tokenizer (one token per word, not "
              f"{model}'s tokenizer): a text prompt's token count, and so its predicted time, differ from "
              "the real model's; send token ids, or give --tokenizer PATH", file=sys.stderr)
    kwargs.update(backend=backend, multiprocess=True)
    if not base:  # vllm serve's step budget and running cap for the device (an experiment resolved its own)
        kwargs = apply_batch_defaults(kwargs, api_server=True)
    return EngineArgs.from_kwargs(model=model, **kwargs)


def check_listen(host: str, port: int) -> None:
    """Raise `ValueError` naming --host / --port when the server could not listen there."""
    import socket  # noqa: PLC0415

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"host: cannot resolve {host!r} ({e.strerror})") from None
    family, type_, proto, _, addr = infos[0]
    with socket.socket(family, type_, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            sock.bind(addr)
        except OSError as e:
            raise ValueError(f"port: cannot listen on {host}:{port} ({e.strerror})") from None


def server_limits(ns: argparse.Namespace) -> Any:
    """`ServerLimits` from the flags given (the defaults for the others), each checked, naming the flag."""
    from servetwin.core.entrypoints.openai.http_limits import ServerLimits  # noqa: PLC0415

    limits = ServerLimits()
    for name, low, what in (("max_request_bytes", 0, ">= 0 (0: no limit)"), ("max_seqs_per_request", 1, ">= 1"),
                            ("max_header_bytes", 1024, ">= 1024"), ("max_header_count", 1, ">= 1")):
        value = getattr(ns, name)
        if value is not None:
            if value < low:
                raise ValueError(f"{name}: must be {what}, got {value}")
            setattr(limits, name, value)
    for name, field in (("read_timeout", "read_timeout_s"), ("timeout_keep_alive", "timeout_keep_alive_s")):
        value = getattr(ns, name)
        if value is not None:
            if not 0 <= value < float("inf"):
                raise ValueError(f"{name}: must be a number of seconds >= 0, got {value}")
            setattr(limits, field, value)
    return limits


def _cmd_serve(ns: argparse.Namespace) -> int:
    from servetwin.core.engine.executor import check_engine_args  # noqa: PLC0415
    from servetwin.core.entrypoints.openai.api_server import check_profiler_dir, run_server  # noqa: PLC0415

    if not ns.time_scale > 0:
        raise ValueError(f"time_scale: must be > 0, got {ns.time_scale}")
    if not 0 < ns.port < 65536:
        raise ValueError(f"port: must be in [1, 65535], got {ns.port}")
    limits = server_limits(ns)
    api_key = ns.api_key if ns.api_key is not None else os.environ.get("SERVETWIN_API_KEY") or None
    args = engine_args_from(ns)
    check_engine_args(args)  # the backend's cheap checks (e.g. torch: max_model_len vs the model's config)
    profiler_dir = ns.profiler_dir or os.environ.get("VLLM_TORCH_PROFILER_DIR") or None
    if profiler_dir is not None:
        check_profiler_dir(profiler_dir)  # a folder the profile could not be written to: found now, exit 2
    check_listen(ns.host, ns.port)  # before the engine loads (minutes for a big model), not after
    print(f"servetwin serve: {args.backend} backend, model {args.model!r} on http://{ns.host}:{ns.port} "
          "(the engine loads in the background; GET /health turns 200 when it is ready)", flush=True)
    return run_server(args, host=ns.host, port=ns.port, served_model_name=ns.served_model_name, pace=ns.pace,
               time_scale=ns.time_scale, fake_step_time_s=ns.fake_step_time, log_level=ns.log_level,
               limits=limits, api_key=api_key, profiler_dir=profiler_dir)


__all__ = ["register", "engine_args_from", "check_listen", "server_limits"]
