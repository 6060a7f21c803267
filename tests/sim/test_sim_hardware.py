"""HardwareSpec presets, YAML loading/saving and field errors."""
import pytest

from servetwin.sim.coefficients import BASIS_TERMS, CostCoefficients
from servetwin.sim.hardware import HardwareSpec, load_hardware, save_hardware
from servetwin.sim.hardware_presets import HARDWARE_PRESETS


def test_coefficient_fields_match_basis_terms():
    assert list(CostCoefficients().to_dict()) == [f"c_{t}" for t in BASIS_TERMS]


def test_cpu_preset_is_marked_uncalibrated():
    hw = load_hardware("cpu")
    assert isinstance(hw, HardwareSpec) and hw.name == "cpu"
    assert hw.provenance["calibrated"] is False
    assert "uncalibrated" in hw.provenance["source"]


@pytest.mark.parametrize("name", ["h100-sxm", "h200", "b200", "a100-80g", "l40s"])
def test_gpu_presets_are_calibrated_with_a_source_per_value(name):
    hw = load_hardware(name)
    assert isinstance(hw, HardwareSpec) and hw.name == name
    # calibrated only where fitted on published runs of that GPU; every preset says what it was judged on
    assert hw.provenance["calibrated"] is (name in ("h100-sxm", "a100-80g"))
    assert hw.provenance["validated_on"].startswith("fitted" if hw.provenance["calibrated"] else "not fitted")
    sources = hw.provenance["coefficients"]
    for field in hw.efficiency.to_dict():
        assert sources.get(f"efficiency.{field}"), field
    for field in ("c_step", "c_req", "c_token"):
        assert sources.get(f"coefficients.{field}"), field
    # physical fractions of the datasheet, never above it
    assert all(0 < v <= 1 for k, v in hw.efficiency.to_dict().items()
               if "half" not in k and not k.endswith(("_rows", "_kernels")))
    for fmt, kernel in hw.efficiency.moe_kernels.items():  # one source per expert format's kernel
        assert sources["efficiency.moe_kernels"].get(fmt), fmt
        assert 0 < kernel.compute <= 1 and 0 < kernel.bandwidth <= 1


def test_fp8_peak_where_the_device_has_it():
    assert load_hardware("h100-sxm").peak_flops("fp8") == pytest.approx(2 * load_hardware("h100-sxm").peak_flops("bfloat16"), rel=1e-3)
    assert load_hardware("a100-80g").peak_flops("fp8") == 312e12  # no fp8 tensor cores: bf16 peak


def test_efficiency_fields_are_checked():
    with pytest.raises(ValueError, match="hardware.efficiency.gemm_compute: a fraction of the datasheet"):
        from servetwin.sim.hardware import hardware_from_dict
        hardware_from_dict({"base": "h100-sxm", "efficiency": {"gemm_compute": 1.5}})
    with pytest.raises(ValueError, match="hardware.efficiency.gemm_bogus: unknown field"):
        hardware_from_dict({"base": "h100-sxm", "efficiency": {"gemm_bogus": 0.5}})


def test_h100_datasheet_numbers():
    hw = load_hardware("h100-sxm")
    assert hw.peak_flops("bfloat16") == 989.4e12
    assert hw.peak_flops("float32") == 66.9e12
    assert hw.memory_bandwidth == 3.35e12


def test_yaml_round_trip(tmp_path):
    hw = load_hardware("h200")
    hw.coefficients.c_step = 1.25e-3
    hw.provenance = {"source": "unit test", "samples": 3, "residuals": {"rmse_s": 1e-4}}
    path = save_hardware(hw, tmp_path / "h200.yaml")
    back = load_hardware(str(path))
    assert back == hw


def test_yaml_base_merges_coefficients(tmp_path):
    p = tmp_path / "cal.yaml"
    p.write_text("base: h100-sxm\nname: h100-cal\ncoefficients:\n  c_step: 2.0e-3\n"
                 "provenance:\n  source: fit\n")
    hw = load_hardware(p)
    base = load_hardware("h100-sxm")
    assert hw.name == "h100-cal" and hw.coefficients.c_step == 2.0e-3
    assert hw.coefficients.c_req == base.coefficients.c_req
    assert hw.memory_bandwidth == base.memory_bandwidth
    assert hw.provenance == {"source": "fit"}


def test_yaml_numeric_strings_are_accepted(tmp_path):
    # YAML 1.1 reads 1e12 (no dot, no exponent sign) as a string.
    p = tmp_path / "hw.yaml"
    p.write_text("name: x\ndevice_type: cuda\npeak_flops_bf16: 1e15\npeak_flops_fp32: 5e13\n"
                 "memory_bandwidth: 2e12\nmemory_bytes: 8e10\n")
    hw = load_hardware(p)
    assert hw.peak_flops_bf16 == 1e15 and hw.memory_bytes == 80_000_000_000


@pytest.mark.parametrize("text, field", [
    ("base: h100-sxm\nflops: 1\n", "hardware.flops: unknown field"),
    ("base: h100-sxm\ncoefficients:\n  c_foo: 1\n", "hardware.coefficients.c_foo: unknown field"),
    ("base: h100-sxm\nmemory_bandwidth: -1\n", "hardware.memory_bandwidth: must be > 0"),
    ("base: h100-sxm\ncoefficients:\n  c_step: -1\n", "hardware.coefficients.c_step: must be >= 0"),
    ("base: h100-sxm\ndevice_type: tpu\n", "hardware.device_type: must be one of"),
    ("base: b300\n", "hardware.base: must be one of"),
    ("name: x\ndevice_type: cuda\n", "hardware.peak_flops_bf16: required field is missing"),
    ("base: h100-sxm\npeak_flops_fp32: fast\n", "hardware.peak_flops_fp32: must be a number"),
    ("- 1\n- 2\n", "hardware: must be a mapping"),
])
def test_yaml_errors_name_the_field(tmp_path, text, field):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace(".", r"\.")):
        load_hardware(p)


def test_unknown_name_or_missing_file():
    with pytest.raises(ValueError, match="neither a preset"):
        load_hardware("no-such-gpu")


def test_presets_are_not_mutated_by_loading():
    hw = load_hardware("cpu")
    hw.coefficients.c_step = 99.0
    assert load_hardware("cpu").coefficients.c_step == HARDWARE_PRESETS["cpu"]["coefficients"]["c_step"]
