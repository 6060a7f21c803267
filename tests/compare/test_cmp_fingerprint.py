"""`compare` says when its calibration was made on another machine, thread count or dtype."""
from servetwin.experiments.calibrate.calibrate import device_name, fingerprint_differences, machine_fingerprint


def test_same_machine_no_notes():
    here = machine_fingerprint("cpu")
    prov = {"machine": dict(here), "torch_threads": 1, "dtype": "float32"}
    assert fingerprint_differences(prov, here, 1, "float32") == []


def test_other_cpu_threads_and_dtype_are_named():
    here = machine_fingerprint("cpu")
    prov = {"machine": {**here, "cpu_model": "Some Other CPU", "logical_cpus": 64}, "torch_threads": 4,
            "dtype": "bfloat16"}
    notes = fingerprint_differences(prov, here, 1, "float32")
    assert any("CPU 'Some Other CPU'" in n for n in notes)
    assert any("logical CPU count 64" in n for n in notes)
    assert any("4 torch thread(s), this run uses 1" in n for n in notes)
    assert any("measured in bfloat16" in n for n in notes)


def test_files_without_a_fingerprint_fall_back_to_the_device_text():
    here = machine_fingerprint("cpu")
    assert fingerprint_differences({"device": device_name("cpu")}, here, 1) == []
    notes = fingerprint_differences({"device": "AMD EPYC 9654 (192 logical CPUs, x86_64)"}, here, 1)
    assert notes and "AMD EPYC 9654" in notes[0]


def test_other_kernel_flags_and_torch_version_are_named():
    here = dict(machine_fingerprint("cpu"), isa_flags=["avx2", "avx512f", "avx512_bf16"], torch="2.13.0+cpu")
    prov = {"machine": {**here, "isa_flags": ["avx2"], "torch": "2.5.1"}, "torch_threads": 1, "dtype": "float32"}
    notes = fingerprint_differences(prov, here, 1, "float32")
    flags = next(n for n in notes if "kernel-speed flags" in n)
    assert "avx512_bf16 only here" in flags and "avx512f only here" in flags and "hardware: auto" in flags
    assert any("torch 2.5.1, here 2.13.0+cpu" in n for n in notes)
    old = {"machine": {k: v for k, v in here.items() if k not in ("isa_flags", "torch")}}
    assert any("does not record its CPU's ISA flags" in n for n in fingerprint_differences(old, here, 1))
