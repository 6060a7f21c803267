"""Length distributions."""
import numpy as np
import pytest

from servetwin.sim.lengths import Empirical, Fixed, LogNormal, Normal, Uniform, parse_length_dist


def _rng():
    return np.random.default_rng(123)


def test_fixed_and_uniform_bounds():
    assert parse_length_dist(7, "x").sample(_rng(), 3).tolist() == [7, 7, 7]
    u = parse_length_dist({"type": "uniform", "low": 3, "high": 5}, "x")
    assert isinstance(u, Uniform)
    assert set(u.sample(_rng(), 2000).tolist()) == {3, 4, 5}


def test_normal_is_clipped_at_one():
    n = parse_length_dist({"type": "normal", "mean": 2, "std": 10}, "x")
    assert isinstance(n, Normal)
    x = n.sample(_rng(), 5000)
    assert x.min() == 1 and x.dtype == np.int64


@pytest.mark.parametrize("cfg", [{"type": "lognormal", "mean": 400, "cv": 1.5},
                                 {"type": "lognormal", "mean": 400, "sigma": 1.0}])
def test_lognormal_mean_and_cv(cfg):
    d = parse_length_dist(cfg, "x")
    assert isinstance(d, LogNormal)
    x = d.sample(_rng(), 200_000).astype(float)
    assert x.mean() == pytest.approx(400, rel=0.03)
    cv = cfg.get("cv", np.sqrt(np.expm1(1.0)))  # cv of a lognormal with sigma 1
    assert x.std() / x.mean() == pytest.approx(cv, rel=0.08)


def test_empirical_from_values_and_file(tmp_path):
    p = tmp_path / "lens.txt"
    p.write_text("# prompt lengths\n10\n20\n\n30  # third\n")
    d = parse_length_dist({"type": "empirical", "path": str(p)}, "x")
    assert isinstance(d, Empirical) and d.values == (10, 20, 30)
    assert set(d.sample(_rng(), 500).tolist()) == {10, 20, 30}
    v = parse_length_dist({"type": "empirical", "values": [4, 4, 9]}, "x")
    assert v.mean == pytest.approx(17 / 3)
    p.write_text("abc\n")
    with pytest.raises(ValueError, match="lens.txt:1: not an integer length"):
        parse_length_dist({"type": "empirical", "path": str(p)}, "x")


def test_suffix_lengths_may_be_zero():
    assert parse_length_dist(0, "s", min_value=0).sample(_rng(), 2).tolist() == [0, 0]
    with pytest.raises(ValueError, match="p: must be >= 1"):
        parse_length_dist(0, "p")
    assert Fixed(0, min_value=0).mean == 0.0
