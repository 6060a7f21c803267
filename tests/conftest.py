"""Suite-wide: `hardware: auto` (the `make run` config) must not measure this machine in a test.

Calibrations go to a temporary cache, pre-seeded with the shipped examples (tiny-llama and tiny-llama-wide float32,
smollm2-135m bfloat16) under this machine's fingerprint, so configs with `hardware: auto` (`make run`'s, the
compare_smollm2_* and TP ones) run with the coefficients the tests always used;
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

    examples = Path(__file__).resolve().parents[1] / "experiments" / "calibrations"
    for name, model, dtype in (("cpu_tiny-llama.yaml", "tiny-llama", "float32"),
                               ("cpu_tiny-llama-wide.yaml", "tiny-llama-wide", "float32"),
                               ("cpu_smollm2-135m.yaml", "smollm2-135m", "bfloat16")):
        shutil.copyfile(examples / name, cache_path(fingerprint(model, dtype, THREADS)))
    _add_gloo_link(cache_path(fingerprint("tiny-llama", "float32", THREADS)))


# The shipped example predates the calibration's gloo all-reduce term; the seeded copy gets the link one
# `calibrate` measured on the 2-core dev machine (experiments/calibrate/allreduce.py at TP=2, tiny-llama's
# hidden size, under load: 404 us + bytes / 2.33 GB/s), so TP configs with `hardware: auto` validate.
GLOO_LINK = {"interconnect_bandwidth": 2.33e9, "interconnect_latency_s": 404e-6}


def _add_gloo_link(path) -> None:
    text = Path(path).read_text()
    for key, value in GLOO_LINK.items():
        text = text.replace(f"{key}: 0.0\n", f"{key}: {value}\n", 1)
    Path(path).write_text(text)


def pytest_unconfigure(config):
    cache = os.environ.get("SERVETWIN_CALIBRATIONS", "")
    if os.path.basename(cache).startswith("servetwin-calibrations-"):
        shutil.rmtree(cache, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """Against the optional compiled build (`make test-compiled`): a test marked
    `@pytest.mark.pure_python("why")` instruments the implementation (patches a method or a module
    global, reads a module's source) and is skipped, since compiled calls bypass such patches; the
    pure-Python pass, the reference, runs it. `SERVETWIN_EXPECT_COMPILED=1` makes sure the build is in use."""
    import pytest
    import servetwin

    compiled = servetwin.compiled_modules()
    if os.environ.get("SERVETWIN_EXPECT_COMPILED") == "1" and not compiled:
        raise pytest.UsageError("SERVETWIN_EXPECT_COMPILED=1 but no servetwin module runs compiled: "
                                "run scripts/build_compiled.py first (make build-compiled)")
    if not compiled:
        return
    for item in items:
        marker = item.get_closest_marker("pure_python")
        if marker is not None:
            item.add_marker(pytest.mark.skip(reason=f"compiled build: {marker.args[0]}"))
