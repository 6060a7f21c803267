"""What a vLLM server's log states about the engine, and a check of servetwin's own KV sizing against it.

The lines read (vLLM's logger format strings; examples in tests/data/vllm_logs, copied from public threads):

| fact | line |
|---|---|
| version | `vLLM API server version X`, `Initializing a V1 LLM engine (vX) with config`, `Initializing an LLM engine (vX)` |
| engine arguments | `non-default args: {...}` (a Python dict repr) |
| model, TP | the non-default args' `model` / `tensor_parallel_size`, else the engine config line's `model='...'`, `tensor_parallel_size=N` |
| KV pool | `GPU KV cache size: N tokens` (V1), `# GPU blocks: N` (early V1), `# cuda blocks: N, # CPU blocks: M` (V0), the API server's `num_gpu_blocks is: N` |
| KV memory | `Available KV cache memory: X GiB`, V0's `the rest of the memory reserved for KV Cache is X GiB`, the worker's memory summary (2026) `Current kv cache memory in use is X GiB` |
| gpu_memory_utilization | V0's `gpu_memory_utilization (X)`, the worker's memory summary `Desired GPU memory utilization is (X, ...)` |
| max_model_len in use | `Maximum concurrency for N tokens per request`, `Using max model len N` (a smaller value than the `max_model_len` asked for = reduced to fit the KV cache) |
| model memory | `Model loading took X GiB` / `Loading model weights took X GB`, V0's `model weights take X GiB` |
| token budget | `Chunked prefill is enabled with max_num_batched_tokens=N` |
| CUDA graphs | `cudagraph_capture_sizes` in the engine config line; else the capture progress bars' counts (`Capturing CUDA graphs (decode, FULL): ... 35/35`) |

Lines may carry a process prefix (`(EngineCore pid=...)`, `(Worker_TP0 pid=...)`); the last value of a
fact wins (a restarted server). Nothing here is guessed: a fact the log does not state stays None.
"""
from __future__ import annotations

import ast
import io
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from servetwin.core.config_error import ConfigError
from servetwin.core.limits import printable, read_bytes

_NUM = r"([\d,]+)"
_PATTERNS: dict[str, re.Pattern] = {
    "vllm_version": re.compile(r"vLLM API server version (\S+)|Initializing an? (?:V1 )?LLM engine \(v?([^)\s]+)\)"),
    "kv_cache_tokens": re.compile(rf"GPU KV cache size: {_NUM} tokens"),
    "num_gpu_blocks": re.compile(rf"# (?:GPU|cuda) blocks: {_NUM}|num_gpu_blocks is: {_NUM}"),
    "max_model_len": re.compile(rf"Maximum concurrency for {_NUM} tokens per request|Using max model len {_NUM}"),
    "model_loading_gib": re.compile(r"Model loading took ([\d.]+) ?GiB|Loading model weights took ([\d.]+) ?GB"
                                    r"|model weights take ([\d.]+) ?GiB"),
    "kv_cache_gib": re.compile(r"Available KV cache memory: ([\d.]+) ?GiB|reserved for KV Cache is ([\d.]+) ?GiB"
                              r"|Current kv cache memory in use is ([\d.]+) ?GiB"),
    "max_num_batched_tokens": re.compile(rf"Chunked prefill is enabled with max_num_batched_tokens={_NUM}"),
    "gpu_memory_utilization": re.compile(r"gpu_memory_utilization \(([\d.]+)\)"
                                        r"|Desired GPU memory utilization is \(([\d.]+),"),
}
# Every pattern is linear in the line: an unbounded `.*?` or `[^)]*` after a literal that repeats would be
# tried from each repeat to the end of the line (a 1 MB line of "Capturing CUDA graphs (" took minutes).
_NON_DEFAULT = "non-default args: "
_CAPTURE = re.compile(r"Capturing CUDA graphs? \(([^)\n]{0,200})\)[^\n]{0,300}?\|\s{0,8}(\d{1,9})/(\d{1,9})")
_CAPTURE_SIZES = re.compile(r"['\"]cudagraph_capture_sizes['\"]: \[([\d,\s]{0,100000})\]")
_CONFIG_FIELD = re.compile(r"\b(model|tensor_parallel_size|max_seq_len)=('([^'\n]{0,1000})'|\d+)")
MAX_NON_DEFAULT_CHARS = 1 << 20  # the `non-default args` dict repr read with ast.literal_eval
_MAX_DIGITS = 30
# engine settings an imported case takes from the log (vLLM argument name -> servetwin engine field)
ENGINE_ARGS = {"max_num_seqs": "max_num_seqs", "max_num_batched_tokens": "max_num_batched_tokens",
               "enable_prefix_caching": "enable_prefix_caching", "enable_chunked_prefill": "enable_chunked_prefill",
               "gpu_memory_utilization": "gpu_memory_utilization", "block_size": "block_size",
               "kv_cache_dtype": "kv_cache_dtype", "enforce_eager": "enforce_eager", "dtype": "dtype",
               "max_cudagraph_capture_size": "max_cudagraph_capture_size"}


@dataclass(slots=True)
class ServerLog:
    path: str
    vllm_version: Optional[str] = None
    model: Optional[str] = None
    tensor_parallel_size: Optional[int] = None
    kv_cache_tokens: Optional[int] = None
    num_gpu_blocks: Optional[int] = None
    max_model_len: Optional[int] = None  # the length the engine runs with
    requested_max_model_len: Optional[int] = None  # --max-model-len as given
    model_loading_gib: Optional[float] = None
    kv_cache_gib: Optional[float] = None
    max_num_batched_tokens: Optional[int] = None
    gpu_memory_utilization: Optional[float] = None  # V0's memory-profiling line, the 2026 worker summary
    cuda_graph_sizes: Optional[list[int]] = None
    cuda_graph_captures: dict[str, int] = field(default_factory=dict)  # capture bar label -> graphs
    non_default_args: dict[str, Any] = field(default_factory=dict)

    @property
    def reduced_max_model_len(self) -> bool:
        return bool(self.requested_max_model_len and self.max_model_len
                    and self.max_model_len < self.requested_max_model_len)

    @property
    def block_size(self) -> Optional[int]:
        """KV tokens per block where the log states both counts (V1 states tokens, V0/early V1 blocks)."""
        given = self.non_default_args.get("block_size")
        if isinstance(given, int):
            return given
        if self.kv_cache_tokens and self.num_gpu_blocks and self.kv_cache_tokens % self.num_gpu_blocks == 0:
            return self.kv_cache_tokens // self.num_gpu_blocks
        return None


def _first_group(m: re.Match) -> str:
    return next(g for g in m.groups() if g is not None)


def _convert(name: str, text: str, where: str) -> Any:
    if name == "vllm_version":
        return printable(text, 80)
    if len(text) > _MAX_DIGITS:
        raise ConfigError(where, f"{name}: a number of {len(text)} characters (not a vLLM log line?)")
    if name.endswith("_gib") or name == "gpu_memory_utilization":
        try:
            return float(text)
        except ValueError:
            raise ConfigError(where, f"{name}: {printable(text, 40)!r} is not a number") from None
    return int(text.replace(",", ""))


def _non_default_args(line: str, where: str) -> Any:
    """The dict after `non-default args: ` at the end of a line (None: no such line)."""
    at = line.find(_NON_DEFAULT)
    if at < 0:
        return None
    text = line[at + len(_NON_DEFAULT):].rstrip()
    if not (text.startswith("{") and text.endswith("}")):
        return None
    if len(text) > MAX_NON_DEFAULT_CHARS:
        raise ConfigError(where, f"the non-default args are {len(text)} characters, more than the limit of "
                                 f"{MAX_NON_DEFAULT_CHARS}")
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, RecursionError, MemoryError, TypeError):
        raise ConfigError(where, "the non-default args are not a readable dict") from None


def _lines(text: str):
    """(number, line) without a list of every line (a log of 256M newlines would need 2 GB of pointers);
    \r, \n and \r\n end a line, as a terminal shows a progress bar's updates."""
    for number, line in enumerate(io.StringIO(text, newline=None), start=1):
        yield number, line.rstrip("\n")


def parse_server_log(text: str, path: str = "log") -> ServerLog:
    log = ServerLog(path)
    for number, line in _lines(text):
        where = f"{path}:{number}"
        for name, pattern in _PATTERNS.items():
            m = pattern.search(line)
            if m:
                setattr(log, name, _convert(name, _first_group(m), where))
        args = _non_default_args(line, where)
        if isinstance(args, dict):
            log.non_default_args = args
        for key, raw, quoted in _CONFIG_FIELD.findall(line) if "with config:" in line else ():
            value = printable(quoted, 200) if key == "model" else _convert(key, raw, where)
            setattr(log, {"max_seq_len": "max_model_len"}.get(key, key), value)
        m = _CAPTURE_SIZES.search(line)
        if m:
            log.cuda_graph_sizes = [_convert("cudagraph_capture_sizes", x, where)
                                    for x in m.group(1).replace(" ", "").split(",") if x]
        m = _CAPTURE.search(line)
        if m and m.group(2) == m.group(3):
            log.cuda_graph_captures[m.group(1)] = int(m.group(3))
    args = log.non_default_args
    if isinstance(args.get("model"), str):
        log.model = args["model"]
    if isinstance(args.get("tensor_parallel_size"), int):
        log.tensor_parallel_size = args["tensor_parallel_size"]
    if isinstance(args.get("max_model_len"), int):
        log.requested_max_model_len = args["max_model_len"]
    if isinstance(args.get("gpu_memory_utilization"), float):
        log.gpu_memory_utilization = args["gpu_memory_utilization"]
    return log


def read_server_log(path: str | Path) -> ServerLog:
    """A server log read through `core.limits.read_bytes` (regular file, size and inflated-size limits;
    a .gz log is inflated); bytes that are not UTF-8 are replaced (a log may mix encodings)."""
    text = read_bytes(path, "log").decode("utf-8", errors="replace")
    log = parse_server_log(text, str(path))
    if not any((log.vllm_version, log.kv_cache_tokens, log.num_gpu_blocks, log.non_default_args, log.max_model_len,
                log.model_loading_gib)):
        raise ConfigError(str(path), "no vLLM startup line found (version, non-default args, KV cache size, "
                                     "# GPU blocks, Maximum concurrency): not a vLLM server log?")
    return log


def engine_settings(log: ServerLog) -> dict[str, tuple[Any, str]]:
    """{servetwin engine field: (value, where the log says it)} for an imported case."""
    out: dict[str, tuple[Any, str]] = {}
    for arg, name in ENGINE_ARGS.items():
        if arg in log.non_default_args:
            out[name] = (log.non_default_args[arg], "the log's non-default args")
    if log.tensor_parallel_size:
        out["tensor_parallel_size"] = (log.tensor_parallel_size, "the log")
    if log.max_model_len:
        note = (f"the log (reduced from the requested {log.requested_max_model_len} to fit the KV cache)"
                if log.reduced_max_model_len else "the log")
        out["max_model_len"] = (log.max_model_len, note)
    if log.cuda_graph_sizes and "max_cudagraph_capture_size" not in out:  # steps up to the largest are padded
        out["max_cudagraph_capture_size"] = (max(log.cuda_graph_sizes), "the log's cudagraph_capture_sizes")
    if log.max_num_batched_tokens and "max_num_batched_tokens" not in out:
        out["max_num_batched_tokens"] = (log.max_num_batched_tokens, "the log's chunked-prefill line")
    blocks = log.num_gpu_blocks or (log.kv_cache_tokens // log.block_size if log.kv_cache_tokens and log.block_size
                                    else None)
    if blocks:
        out["num_gpu_blocks"] = (blocks, "the log's KV pool (vLLM's own sizing)")
    return out


def apply_to_options(log: ServerLog, opts: Any, path: str) -> None:
    """Fill an `ImportOptions` from the log where its flags leave a field open."""
    for name, (value, source) in engine_settings(log).items():
        if name == "tensor_parallel_size":
            opts.tensor_parallel_size = opts.tensor_parallel_size or value
            continue
        opts.engine[name] = value
        opts.engine_sources[name] = f"{value} from {source} ({Path(path).name})"
    if log.vllm_version and not opts.vllm_version:
        opts.vllm_version = log.vllm_version
    if log.model and not opts.model and not log.model.startswith(("/", ".", "~")):
        opts.model = log.model


def kv_check(log: ServerLog, model: str, hardware: str, tp: Optional[int] = None) -> dict[str, Any]:
    """servetwin's KV pool for the log's setup (model, hardware, TP, gpu_memory_utilization, max_model_len)
    next to vLLM's: tokens each, and the difference (servetwin - vLLM) / vLLM."""
    from servetwin.core.engine.engine_args import EngineArgs  # noqa: PLC0415
    from servetwin.core.engine.engine_factory import create_engine_core  # noqa: PLC0415
    from servetwin.sim.hardware import load_hardware  # noqa: PLC0415

    notes = []
    block = log.block_size
    if block is None and log.num_gpu_blocks and not log.kv_cache_tokens:
        block = 16
        notes.append("block size not in the log: vLLM's default 16 assumed")
    vllm_tokens = log.kv_cache_tokens or (log.num_gpu_blocks * block if log.num_gpu_blocks else None)
    if vllm_tokens is None:
        raise ConfigError(log.path, "the log states no KV pool (GPU KV cache size, # GPU blocks)")
    kwargs: dict[str, Any] = {"model": model, "backend": "sim", "hardware": load_hardware(hardware),
                              "tensor_parallel_size": tp or log.tensor_parallel_size or 1}
    for arg in ("gpu_memory_utilization", "block_size", "kv_cache_dtype", "dtype"):
        if arg in log.non_default_args:
            kwargs[arg] = log.non_default_args[arg]
    if log.gpu_memory_utilization and "gpu_memory_utilization" not in kwargs:
        kwargs["gpu_memory_utilization"] = log.gpu_memory_utilization
    if log.max_model_len:
        kwargs["max_model_len"] = log.max_model_len
    _, info = create_engine_core(EngineArgs.from_kwargs(**kwargs))
    ours = int(info.num_gpu_blocks) * int(kwargs.get("block_size", 16))
    return {"vllm_kv_tokens": vllm_tokens, "servetwin_kv_tokens": ours, "notes": notes,
            "difference": (ours - vllm_tokens) / vllm_tokens, "setup": {k: v for k, v in kwargs.items() if k != "hardware"}
            | {"hardware": hardware}}


def describe(log: ServerLog) -> list[str]:
    facts = [("vLLM version", log.vllm_version), ("model", log.model), ("tensor parallel size", log.tensor_parallel_size),
             ("KV cache tokens", log.kv_cache_tokens), ("GPU blocks", log.num_gpu_blocks),
             ("block size", log.block_size), ("max_model_len in use", log.max_model_len),
             ("max_model_len requested", log.requested_max_model_len),
             ("model loading GiB", log.model_loading_gib), ("KV cache GiB", log.kv_cache_gib),
             ("max_num_batched_tokens", log.max_num_batched_tokens),
             ("gpu_memory_utilization", log.gpu_memory_utilization), ("CUDA graph sizes", log.cuda_graph_sizes),
             ("CUDA graphs captured", log.cuda_graph_captures or None),
             ("non-default args", log.non_default_args or None)]
    # every value came from the file: control characters escaped (a log must not drive the terminal)
    lines = [f"{name}: {printable(value, 2000)}" for name, value in facts if value is not None]
    if log.reduced_max_model_len:
        lines.append(f"max_model_len was reduced from {log.requested_max_model_len} to {log.max_model_len}")
    return lines


def _cmd_log(args) -> int:
    log = read_server_log(args.log)
    for line in describe(log):
        print(line)
    if args.hardware:
        model = args.model or log.model
        if not model or model.startswith(("/", ".", "~")):
            raise ConfigError("--model", f"the log's model {model!r} is not a model servetwin knows; give --model")
        check = kv_check(log, model, args.hardware, args.tensor_parallel_size)
        print(f"KV cache: vLLM {check['vllm_kv_tokens']:,} tokens, servetwin {check['servetwin_kv_tokens']:,} tokens "
              f"({100 * check['difference']:+.1f}%) for {printable(check['setup'], 2000)}" + "".join(f"; {n}" for n in check["notes"]))
    return 0


def register(sub) -> None:
    p = sub.add_parser("vllm-log", help="a vLLM server log: version, model, TP, KV pool, max_model_len, CUDA graphs; "
                                        "with --hardware, servetwin's KV sizing next to vLLM's",
                       description="Prints what the log states. Pass the same log to `import vllm-bench --server-log` "
                                   "to take the engine settings into an imported case.")
    p.add_argument("log", help="the server's log (stdout/stderr of vllm serve)")
    p.add_argument("--hardware", help="check servetwin's KV pool for this GPU preset against the log's")
    p.add_argument("--model", help="the model (when the log names a local path)")
    p.add_argument("--tensor-parallel-size", type=int, help="TP size (when the log does not state it)")
    p.set_defaults(func=_cmd_log)
