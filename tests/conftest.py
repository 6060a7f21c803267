"""Suite-wide: `hardware: auto` (the `make run` config) must not measure this machine in a test.

Calibrations go to a temporary cache, pre-seeded with the shipped tiny-llama example under this
machine's fingerprint, so configs with `hardware: auto` run with the coefficients the tests always used;
tests of the automatic calibration inject their own (tests/experiments/test_exp_auto_calibration.py)."""
import os
import shutil
import tempfile
from pathlib import Path


def pytest_configure(config):
    if "SERVETWIN_CALIBRATIONS" in os.environ:
        return
    cache = tempfile.mkdtemp(prefix="servetwin-calibrations-")
    os.environ["SERVETWIN_CALIBRATIONS"] = cache  # subprocesses (nbconvert, workers) inherit it
    from servetwin.experiments.calibrate.auto_calibration import THREADS, cache_path, fingerprint

    example = Path(__file__).resolve().parents[1] / "experiments" / "calibrations" / "cpu_tiny-llama.yaml"
    shutil.copyfile(example, cache_path(fingerprint("tiny-llama", "float32", THREADS)))


def pytest_unconfigure(config):
    cache = os.environ.get("SERVETWIN_CALIBRATIONS", "")
    if os.path.basename(cache).startswith("servetwin-calibrations-"):
        shutil.rmtree(cache, ignore_errors=True)
