"""The shipped calibrations and compare configs: load, carry their provenance, and fit together."""
from __future__ import annotations

import pytest
import yaml
from cmptest_helpers import CALIBRATIONS, CONFIGS

from servetwin.experiments.config.schema import load_config
from servetwin.sim.hardware import load_hardware
from servetwin.sim.model_spec import load_model_spec

SHIPPED = {"cpu_smollm2-135m.yaml": "smollm2-135m", "cpu_tiny-llama.yaml": "tiny-llama",
           "cpu_smollm2-135m-fp32-avx2.yaml": "smollm2-135m"}
DTYPES = {"cpu_smollm2-135m.yaml": "bfloat16"}  # the others: float32
COMPARE_CONFIGS = sorted(CONFIGS.glob("compare_*.yaml"))


@pytest.mark.parametrize("name,model", sorted(SHIPPED.items()))
def test_shipped_calibration_loads_with_provenance(name, model):
    path = CALIBRATIONS / name
    raw = yaml.safe_load(path.read_text())
    assert raw["base"] == "cpu"
    for key in ("peak_flops_bf16", "peak_flops_fp32", "memory_bandwidth", "memory_bytes"):
        assert raw[key] > 0, key
    hw = load_hardware(str(path))
    prov = hw.provenance
    assert prov["calibrated"] is True and prov["model"] == model
    assert prov["device"] and prov["date"] and prov["versions"]["torch"] and prov["versions"]["servetwin"]
    assert prov["attention_backend"] == "torch-paged" and prov["cuda_graphs"] is False
    assert prov["torch_threads"] >= 1 and prov["samples"] >= 100 and prov["design"]
    assert prov["dtype"] == DTYPES.get(name, "float32")
    res = prov["residuals"]
    for part in ("all_samples", "used_samples"):
        assert 0 <= res[part]["median_abs_rel_err"] <= res[part]["p90_abs_rel_err"]
    assert prov["samples_used"] <= prov["samples"]
    assert hw.coefficients.c_layer == 0.0  # eager CPU backend
    load_model_spec(model)


def test_there_are_offline_online_and_held_out_compare_configs():
    names = {p.stem for p in COMPARE_CONFIGS}
    assert {"compare_smollm2_offline", "compare_smollm2_online"} <= names
    assert len(names) >= 4


@pytest.mark.parametrize("path", COMPARE_CONFIGS, ids=lambda p: p.stem)
def test_compare_configs_validate_and_use_a_matching_calibration(path):
    exp = load_config(path)
    assert set(exp.backends) == {"sim", "torch"}
    hw = load_hardware(exp.hardware)
    assert hw.provenance.get("calibrated") is True
    assert hw.provenance["model"] == exp.model
    assert exp.engine.given.get("dtype", hw.provenance["dtype"]) == hw.provenance["dtype"]
    assert exp.engine.given["device"] == "cpu" and exp.engine.given["num_gpu_blocks"] >= 2
