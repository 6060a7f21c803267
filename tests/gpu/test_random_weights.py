"""A config-only model directory with the random-weights marker loads with seeded weights drawn on the device."""
import json
import shutil

import torch

from servetwin.gpu.loader import RANDOM_WEIGHTS_MARKER, load_model
from servetwin.gpu.models.registry import resolve_model


def _random_dir(tmp_path, seed):
    src = resolve_model("tiny-llama").path
    d = tmp_path / f"random-{seed}"
    d.mkdir(exist_ok=True)
    shutil.copy(src / "config.json", d / "config.json")
    (d / RANDOM_WEIGHTS_MARKER).write_text(json.dumps({"seed": seed}))
    return d


def test_random_weight_model_loads_without_a_checkpoint(tmp_path):
    a = load_model(str(_random_dir(tmp_path, 0)), dtype=torch.bfloat16)
    b = load_model(str(_random_dir(tmp_path, 0)), dtype=torch.bfloat16)
    c = load_model(str(_random_dir(tmp_path, 1)), dtype=torch.bfloat16)
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(p.dtype == torch.bfloat16 and torch.isfinite(p.float()).all() for p in pa.values())
    assert all(torch.equal(pa[k], pb[k]) for k in pa)  # seeded: reproducible
    assert any(not torch.equal(pa[k], pc[k]) for k in pa)
    norm = next(k for k in pa if k.endswith("norm.weight"))
    assert abs(float(pa[norm].detach().float().mean()) - 1.0) < 0.1
