"""A `BenchRecord` as a `servetwin validate` case: `cases/NAME.yaml` + `published.json` (+ the requests).

What the file says is used as it is; what it does not say comes from `ImportOptions` (flags, a server
log) and is otherwise named in the error or in a note, never filled in silently:

- model: `--model`, else the file's `model_id` when servetwin knows that name (often a local path);
- hardware: `--hardware` (no result file records the GPU);
- tensor parallel size: `--tensor-parallel-size`, a server log, InferenceMAX's `tp`; else 1, noted;
- lengths: a detailed file's per-request `input_lens` / `output_lens` in the client's order (a trace
  file); SGLang's `random_input_len` / `random_range_ratio` (uniform, as its sampler draws them);
  otherwise every request gets the file's mean (`total_input_tokens / completed`), noted;
- arrivals: `request_rate` "inf" -> all at t = 0 (`max_concurrency` -> a closed loop of that many
  clients); a finite rate -> Poisson (`burstiness` 1) or gamma gaps with cv = 1 / sqrt(burstiness),
  vLLM's `np.random.gamma(shape=burstiness, scale=1 / (rate * burstiness))`. The bench files do not
  record send times, so a trace's arrival times are drawn with that process (seed 0), noted.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from servetwin.core.config_error import ConfigError
from servetwin.core.limits import MAX_IMPORT_FILE_BYTES, printable
from servetwin.experiments.validate.published import IMPORT_INCOMPLETE_MARKER
from servetwin.experiments.vllm_import.assumptions import (Assumption, infer_fp8, infer_tp_from_name,
                                                            infer_version_from_name, ingress_for,
                                                            version_assumptions)
from servetwin.experiments.vllm_import.bench_file import BenchRecord


@dataclass(slots=True)
class ImportOptions:
    model: Optional[str] = None
    hardware: Optional[str] = None
    tensor_parallel_size: Optional[int] = None
    vllm_version: Optional[str] = None
    num_prompts: Optional[int] = None  # for files without a request count (InferenceMAX)
    input_len: Optional[int] = None  # for files without token totals, or to replace the mean
    output_len: Optional[int] = None
    engine: dict[str, Any] = field(default_factory=dict)  # engine settings from a server log
    engine_sources: dict[str, str] = field(default_factory=dict)  # setting -> where it came from
    name: Optional[str] = None


@dataclass(slots=True)
class ImportedCase:
    name: str
    config: dict[str, Any]  # the experiment YAML's content
    published: dict[str, Any]  # its published.json entry
    trace_rows: Optional[list[tuple[float, int, int]]]  # (arrival_s, prompt, output) when detailed
    notes: list[str]
    assumptions: list[Assumption] = field(default_factory=list)  # every setting the file does not record

    def assumption_block(self) -> str:
        """One block: what the case assumes (value and source), then the notes on how it was read."""
        lines = [f"{self.name}: what the file does not record, and what is used:"]
        lines += [f"  {a.line()}" for a in self.assumptions]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def case_name(record: BenchRecord, given: Optional[str] = None) -> str:
    """The file's stem (or `given`), `_r<N>` for record N of a JSONL file or list (`where` is `f.jsonl:3`)."""
    m = re.fullmatch(r"(.*?)(?::(\d+)|\[(\d+)\])?", record.where)
    stem, number = Path(m.group(1)).stem, m.group(2) or m.group(3)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", (given or stem) + (f"_r{number}" if number else "")).strip("_.")
    return name or "case"


def resolve_model(record: BenchRecord, opts: ImportOptions) -> str:
    from servetwin.sim.model_spec import load_model_spec  # noqa: PLC0415

    if opts.model:
        return opts.model
    mid = record.model_id
    if mid and not mid.startswith(("/", ".", "~")):
        try:
            load_model_spec(mid)
            return mid
        except (ValueError, FileNotFoundError):
            pass
    raise ConfigError("--model", f"{record.where}: the file's model_id {mid!r} is not a model servetwin knows "
                                 "(a local path or an unknown name); give --model (a preset such as llama-3.1-8b, "
                                 "a Hugging Face name servetwin knows, or a config.json folder)")


def resolve_tp(record: BenchRecord, opts: ImportOptions, notes: list[str]) -> tuple[int, str]:
    """(TP size, where it came from): the flag or a server log, the file's own field, the file's name
    (`tp8`, `8xh100`), else 1."""
    if opts.tensor_parallel_size:
        if record.tensor_parallel_size and record.tensor_parallel_size != opts.tensor_parallel_size:
            notes.append(f"tensor_parallel_size: {opts.tensor_parallel_size} from the flag/log, the file says "
                         f"{record.tensor_parallel_size}")
        return opts.tensor_parallel_size, "--tensor-parallel-size or the server log"
    if record.tensor_parallel_size:
        return record.tensor_parallel_size, "the file's tp field"
    named = infer_tp_from_name(record.where)
    if named is not None:
        return named[0], f"the file name says {named[1]!r}; --tensor-parallel-size to change"
    return 1, "assumed: not in the file or its name; give --tensor-parallel-size or a server log"


def resolve_quantization(record: BenchRecord, opts: ImportOptions) -> Optional[Assumption]:
    """fp8 weights when the model id names them and no --engine quantization was given."""
    if "quantization" in opts.engine:
        return Assumption("engine.quantization", str(opts.engine["quantization"]), "--engine")
    if infer_fp8(record.model_id):
        return Assumption("engine.quantization", "fp8", f"the model id {record.model_id!r} names FP8 weights; "
                                                        "--engine quantization=null to change")
    return None


def resolve_version(record: BenchRecord, opts: ImportOptions) -> tuple[Optional[str], str]:
    if opts.vllm_version:
        return opts.vllm_version, "--vllm-version"
    named = infer_version_from_name(record.where)
    if named:
        return named, "the file name; --vllm-version to change"
    return None, "not in the file or its name; --vllm-version to give it"


def _count(record: BenchRecord, opts: ImportOptions) -> int:
    n = opts.num_prompts or record.completed or record.num_prompts
    if not n:
        raise ConfigError("--num-prompts", f"{record.where}: the file has no request count (completed, "
                                           "num_prompts); give --num-prompts")
    return n


def _mean_length(total: Optional[int], flag_value: Optional[int], n: int, what: str, flag: str,
                 record: BenchRecord, notes: list[str]) -> int:
    if flag_value:
        return flag_value
    if total is None:
        raise ConfigError(flag, f"{record.where}: the file has no total_{what}_tokens; give {flag}")
    mean = max(1, round(total / n))
    if total != mean * n:
        notes.append(f"{what} lengths: not in the file; every request gets the mean {total} / {n} = {mean} tokens")
    return mean


def _sglang_random(length: int, ratio: float) -> Any:
    """SGLang's random dataset: lengths uniform in [max(int(L * ratio), 1), L]."""
    low = max(int(length * ratio), 1)
    return length if low >= length else {"type": "uniform", "low": low, "high": length}


def _lengths(record: BenchRecord, opts: ImportOptions, n: int, notes: list[str]) -> dict[str, Any]:
    if (record.client == "sglang" and record.dataset_name == "random" and record.random_input_len
            and record.random_output_len and not (opts.input_len or opts.output_len)):
        ratio = record.random_range_ratio or 0.0
        notes.append(f"lengths: SGLang random dataset, input {record.random_input_len} / output "
                     f"{record.random_output_len}, range ratio {ratio}: uniform in [max(int(L * ratio), 1), L]")
        return {"prompt_tokens": _sglang_random(record.random_input_len, ratio),
                "output_tokens": _sglang_random(record.random_output_len, ratio)}
    return {"prompt_tokens": _mean_length(record.total_input_tokens, opts.input_len, n, "input", "--input-len",
                                          record, notes),
            "output_tokens": _mean_length(record.total_output_tokens, opts.output_len, n, "output", "--output-len",
                                          record, notes)}


def _arrival(record: BenchRecord, notes: list[str]) -> dict[str, Any]:
    if math.isinf(record.request_rate):
        if record.max_concurrency:
            return {"type": "closed_loop", "clients": record.max_concurrency}
        return {"type": "offline"}
    if record.max_concurrency:
        notes.append(f"max_concurrency {record.max_concurrency} with request rate {record.request_rate}/s: the cap "
                     "is not modelled (arrivals follow the rate alone)")
    if record.burstiness == 1.0:
        return {"type": "poisson", "rate": record.request_rate}
    return {"type": "gamma", "rate": record.request_rate, "cv": 1.0 / math.sqrt(record.burstiness)}


def _trace_rows(record: BenchRecord, notes: list[str]) -> list[tuple[float, int, int]]:
    """(arrival_s, prompt, output) of the successful requests, in the client's order."""
    d = record.detailed
    assert d is not None
    keep = [i for i in range(len(d.input_lens)) if not d.errors[i]]
    if len(keep) < len(d.input_lens):
        notes.append(f"{len(d.input_lens) - len(keep)} failed requests (non-empty errors) left out")
    zero = sum(1 for i in keep if d.output_lens[i] == 0)
    if zero:
        notes.append(f"{zero} successful requests returned no tokens (output_lens 0, ttft 0.0 - counted in the "
                     "file's completed and mean TTFT): replayed with 1 output token")
    n = len(keep)
    rng = np.random.default_rng(0)
    if math.isinf(record.request_rate):
        times = np.zeros(n)
    else:
        shape = record.burstiness
        times = np.cumsum(rng.gamma(shape, 1.0 / (record.request_rate * shape), size=n))
        notes.append(f"arrival times: not in the file; the case draws them as vLLM's client sends (gamma gaps "
                     f"shape {shape} at {record.request_rate}/s: workload.arrival, whose rate --set can change); "
                     "the requests file holds one such draw (seed 0)")
    return [(float(t), d.input_lens[i], max(d.output_lens[i], 1)) for t, i in zip(times, keep)]


def _frontend(record: BenchRecord, notes: list[str]) -> dict[str, Any]:
    chat = "chat" in (record.backend or "") or "chat" in (record.endpoint_type or "")
    if record.client == "sglang":
        notes.append("frontend: SGLang's /generate endpoint modelled as vLLM's completions API server")
    return {"type": "api_server", "endpoint": "chat" if chat else "completions"}


def _server_settings(record: BenchRecord, opts: ImportOptions, model: str, notes: list[str]
                     ) -> tuple[dict[str, Any], dict[str, Any], Optional[str], list[Assumption]]:
    """(engine, frontend, vLLM version, assumptions): what the server ran with, each value with its source."""
    tp, tp_source = resolve_tp(record, opts, notes)
    version, version_source = resolve_version(record, opts)
    assumptions = [Assumption("model", model, "--model" if opts.model else "the file's model_id"),
                   Assumption("hardware", str(opts.hardware), "--hardware"),
                   Assumption("engine.tensor_parallel_size", str(tp), tp_source)]
    engine: dict[str, Any] = {"tensor_parallel_size": tp}
    quant = resolve_quantization(record, opts)
    if quant is not None:
        assumptions.append(quant)
        if quant.value != "None":
            engine["quantization"] = quant.value
    engine.update(record.engine)
    engine.update({k: v for k, v in opts.engine.items() if not (k == "quantization" and v is None)})
    for key, src in opts.engine_sources.items():
        if key != "quantization":
            assumptions.append(Assumption(f"engine.{key}", str(opts.engine[key]), src))
    assumptions.append(Assumption("vLLM version", version or "unknown", version_source))
    frontend = _frontend(record, notes)
    if record.client == "vllm" and ingress_for(version):
        frontend["ingress"] = ingress_for(version)
        assumptions.append(Assumption("frontend.ingress", "in_order", f"vLLM {version} tokenises on one thread, "
                                      "in arrival order: docs/frontend_model.md"))
    assumptions += [Assumption("  differs from 0.33", text, "") for text in version_assumptions(version)]
    return engine, frontend, version, assumptions


def _workload(record: BenchRecord, opts: ImportOptions, name: str, notes: list[str]
              ) -> tuple[dict[str, Any], Optional[list[tuple[float, int, int]]]]:
    """(the workload section, the requests file's rows or None)."""
    workload: dict[str, Any] = {"seed": 0}
    if record.detailed is None:
        n = _count(record, opts)
        workload.update(requests=n, **_lengths(record, opts, n, notes), arrival=_arrival(record, notes))
        return workload, None
    rows = _trace_rows(record, notes)
    if record.max_concurrency and math.isinf(record.request_rate):
        notes.append("per-request lengths with max_concurrency: drawn from the file's pairs (a closed loop "
                     "cannot replay a fixed order)")
        workload.update(requests=len(rows), lengths={"type": "empirical", "pairs": [[p, o] for _, p, o in rows]},
                        arrival=_arrival(record, notes))
        return workload, None
    # the file's lengths in order; the send times from the client's process, so a rate can be changed
    workload.update(file=f"{name}.requests.csv", arrival=_arrival(record, notes))
    return workload, rows


def build_case(record: BenchRecord, opts: ImportOptions, prefix: str = "") -> ImportedCase:
    """The case for one record (ConfigError naming the flag or field that is missing); `prefix` goes in
    front of its name (records of several files in one directory)."""
    notes = list(record.notes)
    name = prefix + case_name(record, opts.name)
    model = resolve_model(record, opts)
    if not opts.hardware:
        said = f" (the file says {record.hardware_name!r})" if record.hardware_name else ""
        raise ConfigError("--hardware", f"{record.where}: the file does not record the GPU{said}; give --hardware "
                                        "(a preset such as h100-sxm, or a hardware YAML from servetwin calibrate)")
    engine, frontend, version, assumptions = _server_settings(record, opts, model, notes)
    workload, rows = _workload(record, opts, name, notes)
    config = {"name": name, "seed": 0, "model": model, "hardware": opts.hardware, "backends": ["sim"],
              "frontend": frontend, "engine": engine, "workload": workload,
              "output": {"step_requests": False, "plots": False}}
    engine_version = ("SGLang bench_serving" if record.client == "sglang" else f"vLLM {version}" if version
                      else "unknown (not in the file)")
    if not record.metrics:
        raise ConfigError(record.where, "no figure servetwin can compare (duration, throughputs, TTFT/TPOT/ITL/E2E)")
    published = {"source": f"{record.where} (imported by servetwin import vllm-bench)",
                 "engine_version": engine_version, "client": record.client, "published": dict(record.metrics),
                 "notes": [a.line() for a in assumptions] + notes}
    return ImportedCase(name, config, published, rows, notes, assumptions)




def check_case_free(case: ImportedCase, out_dir: str | Path, overwrite: bool = False) -> None:
    yaml_path = Path(out_dir) / "cases" / f"{case.name}.yaml"
    if yaml_path.exists() and not overwrite:
        raise ConfigError("-o/--output", f"{yaml_path} exists (give --overwrite to replace it)")


def write_case(case: ImportedCase, out_dir: str | Path, overwrite: bool = False) -> Path:
    """Write `out_dir/cases/NAME.yaml` (+ `NAME.requests.csv`); `write_published` adds the entries after."""
    import yaml  # noqa: PLC0415

    from servetwin.core.testbed.atomic import atomic_open  # noqa: PLC0415

    check_case_free(case, out_dir, overwrite)
    cases = Path(out_dir) / "cases"
    yaml_path = cases / f"{case.name}.yaml"
    cases.mkdir(parents=True, exist_ok=True)
    if case.trace_rows is not None:
        with atomic_open(str(cases / f"{case.name}.requests.csv")) as f:
            f.write("arrival_s,prompt_tokens,output_tokens\n")
            f.writelines(f"{t:.6f},{p},{o}\n" for t, p, o in case.trace_rows)
    header = "".join(f"# {line}\n" for line in
                     [f"Imported from {case.published['source']}.", *[f"- {n}" for n in case.published["notes"]]])
    with atomic_open(str(yaml_path)) as f:
        f.write(header + yaml.safe_dump(case.config, sort_keys=False, width=110))
    return yaml_path


def read_published(out_dir: str | Path) -> dict[str, Any]:
    """The directory's `published.json` (empty when there is none), read through `core.limits`."""
    from servetwin.core.limits import load_json_file  # noqa: PLC0415

    pub_path = Path(out_dir) / "published.json"
    if not pub_path.exists():
        return {}
    doc = load_json_file(pub_path, str(pub_path), max_bytes=MAX_IMPORT_FILE_BYTES)
    if not isinstance(doc, dict):
        raise ConfigError(str(pub_path), "must be a JSON object {case name: entry}; not adding to it")
    return doc


def write_published(cases: list[ImportedCase], out_dir: str | Path, published: dict[str, Any]) -> None:
    """`published` (the directory's entries, read before the cases were written) with every case's entry,
    written once (a file of 3,000 records took a minute rewritten after each)."""
    from servetwin.core.testbed.atomic import atomic_open  # noqa: PLC0415

    for case in cases:
        published[case.name] = case.published
    with atomic_open(str(Path(out_dir) / "published.json")) as f:
        json.dump(published, f, indent=1)
        f.write("\n")


def import_cases(cases: list[ImportedCase], out_dir: str | Path, overwrite: bool = False,
                 log: Callable[[str], None] = lambda m: None) -> list[Path]:
    """Write every case and their `published.json` entries. While it runs the directory holds
    `IMPORT_INCOMPLETE_MARKER` (removed last): an import cut short (SIGTERM, a full disk) leaves the directory
    marked, and `servetwin validate` refuses it until the import is run again."""
    out = Path(out_dir)
    for case in cases:  # every name checked before anything is written
        check_case_free(case, out, overwrite)
    published = read_published(out)
    out.mkdir(parents=True, exist_ok=True)
    marker = out / IMPORT_INCOMPLETE_MARKER
    marker.write_text(f"an import into this directory did not finish ({len(cases)} case(s)); run it again\n",
                      encoding="utf-8")
    paths = []
    for k, case in enumerate(cases, start=1):
        paths.append(write_case(case, out, overwrite=True))
        # the assumption block carries the notes; everything echoed from a file is escaped
        log("\n".join(printable(line, 400) for line in case.assumption_block().splitlines()))
        log(f"{printable(case.name)}: wrote {printable(paths[-1], 400)} ({k}/{len(cases)})")
    write_published(cases, out, published)
    marker.unlink()
    return paths
