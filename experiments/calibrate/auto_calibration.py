"""`hardware: auto`: the CPU cost model calibrated on this machine the first time an experiment needs
it, then cached.

A CPU's step times depend on what the kernels can use, so a calibration made on one machine is wrong on
another (an AVX2 EPYC's coefficients put `make run`'s compare 2-3x off on an AVX-512 + BF16 one). The
cache key is therefore a real fingerprint (`fingerprint`): the CPU model name, the ISA flags that change
kernel speed (AVX2, AVX-512, AVX512-BF16, AMX), the logical CPUs and torch threads, the torch version,
the dtype, the model and a digest of the torch backend's code (a faster kernel changes the step
costs). A machine whose fingerprint differs gets its own calibration, made the first
time it is needed (`servetwin calibrate`'s measured design, ~10-20 s for tiny-llama on 2 cores; its
progress printed); later runs read the file. The calibrations in experiments/calibrations/ are
examples of the output, not defaults.

The cache lives in `$SERVETWIN_CALIBRATIONS` (default `$SERVETWIN_CACHE/calibrations`, i.e.
`~/.cache/servetwin/calibrations`); deleting a file forces a new calibration.
`SERVETWIN_AUTO_CALIBRATION_DESIGN=quick` picks the smaller design (the test suite's choice).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from servetwin.core.config_error import ConfigError
from servetwin.core.limits import printable
from servetwin.experiments.calibrate.cpu_info import cpu_name, isa_flags, torch_version

AUTO = "auto"
THREADS = 1  # the shipped calibrations' choice: one torch thread leaves a core to the rest of the process


def backend_digest() -> str:
    """A digest of the torch backend's own code (gpu/, its native kernels' C source included): the step
    costs a calibration measured belong to this code, so a changed backend is calibrated anew."""
    root = Path(__file__).resolve().parents[2] / "gpu"
    h = hashlib.sha1()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def fingerprint(model: str, dtype: str, threads: int = THREADS) -> dict[str, Any]:
    """What a CPU calibration is valid for: equal fingerprints, equal kernels and step costs."""
    return {"model": model, "cpu_model": cpu_name(), "isa_flags": isa_flags(), "logical_cpus": os.cpu_count(),
            "torch_threads": threads, "torch": torch_version(), "dtype": dtype, "arch": platform.machine(),
            "torch_backend": backend_digest()}


def cache_dir() -> Path:
    env = os.environ.get("SERVETWIN_CALIBRATIONS")
    if env:
        return Path(env).expanduser()
    from servetwin.gpu.models.model_files import cache_root  # noqa: PLC0415  (no torch: a path helper)

    return cache_root() / "calibrations"


def cache_path(fp: dict[str, Any]) -> Path:
    key = hashlib.sha1(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir() / f"cpu_{fp['model']}-{key}.yaml"


def _run_calibration(model: str, path: str, dtype: str, threads: int, log: Callable[[str], None]) -> None:
    from servetwin.experiments.calibrate.calibrate import calibrate  # noqa: PLC0415

    design = os.environ.get("SERVETWIN_AUTO_CALIBRATION_DESIGN", "default")
    calibrate(model, path, device="cpu", dtype=dtype, threads=threads, design=design, log=log)


def ensure_calibration(model: str, dtype: str = "float32", threads: int = THREADS,
                       log: Optional[Callable[[str], None]] = None,
                       run: Optional[Callable[..., None]] = None) -> str:
    """The path of this machine's calibration for `model`, calibrating first if the cache has none for
    this fingerprint (one process at a time: a sweep's workers wait for the first). `run`: the
    calibration to call (`_run_calibration`; tests inject a fake one)."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    fp = fingerprint(model, dtype, threads)
    path = cache_path(fp)
    if os.path.lexists(path):
        return check_cached_calibration(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError("hardware: auto", f"cannot create the calibration cache folder {path.parent} "
                                            f"({e.strerror or type(e).__name__}); set SERVETWIN_CALIBRATIONS to a "
                                            "writable folder") from None
    with _calibration_lock(path):  # another process may be calibrating this very fingerprint
        if os.path.lexists(path):
            return check_cached_calibration(path)
        flags = ", ".join(fp["isa_flags"]) or "none known"
        log(f"hardware: auto: no calibration of the CPU cost model for {model} on this machine yet "
            f"({fp['cpu_model']}, {fp['logical_cpus']} CPUs, ISA {flags}, torch {fp['torch']}, {dtype}, "
            f"{threads} thread(s)); measuring one now (once: seconds for a tiny model, about two minutes for SmolLM2-135M on 2 cores), cached as {path}")
        t0 = time.perf_counter()
        (run or _run_calibration)(model, str(path), dtype, threads, log)
        log(f"hardware: auto: calibrated in {time.perf_counter() - t0:.0f} s; later runs read {path}")
    return check_cached_calibration(path)


# Physical bounds of a CPU calibration's coefficients (`servetwin.sim.coefficients`): the roofline terms'
# dimensionless corrections (the shipped tiny-llama file's LM head is 590x its datasheet roofline on a
# CPU) and the engine's seconds per step, request, token or layer. A cached file outside them was edited or
# damaged: its predictions would be absurd (1e30 -> "16/16 requests in 5e22 h"; all 0 -> "0 s").
CORRECTION_TERMS = ("linear", "elementwise", "attn_prefill", "attn_decode", "attn_shared", "lm_head", "sampler",
                    "comm", "moe")
MAX_CORRECTION = 1e5
MAX_SECONDS_PER_UNIT = 10.0
EVERY_STEP_TERMS = ("step", "req", "token", "linear", "lm_head")  # a step with one token pays all of these


def check_cached_calibration(path: Path) -> str:
    """`path`, when it is a readable calibration whose coefficients are within physical bounds; else a
    `ConfigError` naming the file and the fix (delete it: the next run measures it anew)."""
    from servetwin.core.safe_yaml import load_yaml_file  # noqa: PLC0415

    fix = f"delete {path} (the next run calibrates this machine anew)"
    try:
        doc = load_yaml_file(path, "hardware: auto")
    except ConfigError as e:
        raise ConfigError("hardware: auto", f"the cached calibration is unreadable ({e.message}); {fix}") from None
    coeffs = doc.get("coefficients") if isinstance(doc, dict) else None
    if not isinstance(coeffs, dict) or not coeffs:
        raise ConfigError("hardware: auto", f"the cached calibration {path} has no coefficients mapping; {fix}")
    for key, value in coeffs.items():
        term = str(key).removeprefix("c_")
        high = MAX_CORRECTION if term in CORRECTION_TERMS else MAX_SECONDS_PER_UNIT
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= high:
            raise ConfigError("hardware: auto", f"the cached calibration {path} has coefficients.{printable(key, 40)} "
                                                f"= {printable(repr(value), 40)}, outside [0, {high:g}]; {fix}")
    if not any(coeffs.get(f"c_{t}", 0) > 0 for t in EVERY_STEP_TERMS):
        raise ConfigError("hardware: auto", f"the cached calibration {path} prices a step at 0 s (c_step, c_req, "
                                            f"c_token, c_linear and c_lm_head all 0); {fix}")
    return str(path)


def is_auto_calibration(path: str) -> bool:
    """Whether `path` is a calibration this module made (a file in the cache): one it may re-measure."""
    try:
        return Path(path).resolve().parent == cache_dir().resolve() and Path(path).name.startswith("cpu_")
    except OSError:
        return False


def candidate_path(path: str) -> str:
    """Where a re-measured calibration waits until it is judged better than the one at `path`."""
    p = Path(path)
    return str(p.with_name(p.stem + ".candidate" + p.suffix))


def recalibrate(path: str, model: str, dtype: str = "float32", threads: int = THREADS,
                log: Optional[Callable[[str], None]] = None, run: Optional[Callable[..., None]] = None) -> float:
    """Measure this machine's calibration for the cached file `path` again, now (the cached one may no
    longer describe the machine: see `servetwin.experiments.compare.compare`'s drift probe), into
    `candidate_path(path)`; the cached file is untouched until `adopt_candidate`. Returns the wall seconds.
    Runs under the same lock as `ensure_calibration`."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    with _calibration_lock(Path(path)):
        t0 = time.perf_counter()
        (run or _run_calibration)(model, candidate_path(path), dtype, threads, log)
    return time.perf_counter() - t0


def adopt_candidate(path: str, keep: bool) -> None:
    """The re-measured calibration replaces the cached one (`keep`), or is deleted."""
    with _calibration_lock(Path(path)):
        if keep:
            os.replace(candidate_path(path), path)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(candidate_path(path))


@contextlib.contextmanager
def _calibration_lock(path: Path) -> Iterator[None]:
    """One process at a time measures the calibration at `path` (a lock file beside it)."""
    try:
        lock = open(path.with_suffix(".lock"), "w")
    except OSError as e:
        raise ConfigError("hardware: auto", f"cannot write in the calibration cache folder {path.parent} "
                                            f"({e.strerror or type(e).__name__}); set SERVETWIN_CALIBRATIONS to a "
                                            "writable folder") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield

