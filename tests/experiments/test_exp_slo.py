"""SLO parsing (errors name the field), attainment, goodput, and the t statistics behind seeds."""
import math

import pandas as pd
import pytest
from exptest_helpers import tiny

from servetwin.experiments.config.schema import ConfigError, seeds_for, validate_config, with_seed
from servetwin.experiments.config.slo import SloError, evaluate_slo, miss_ratio, parse_slo, parse_slo_args
from servetwin.experiments.common.stats import mean_bound, mean_ci, t_quantile


@pytest.mark.parametrize("cfg,expected", [
    ({"ttft_p95_s": 0.5}, "slo.ttft_p95_s: unknown SLO"),
    ({"ttft_p99": 0.5}, "slo.ttft_p99: unknown SLO (did you mean ttft_p99_s?)"),
    ({"ttft_p99_s": 0}, "slo.ttft_p99_s: must be a positive number of seconds, got 0"),
    ({"e2e_s": "soon"}, "slo.e2e_s: must be a positive number of seconds, got 'soon'"),
    ({"itl_s": 0.1}, "slo.itl_s: unknown SLO"),
    ({"ttft_p99_s": 1, "min_attainment": 0.9}, "slo.min_attainment: needs at least one per-request deadline"),
    ({"e2e_s": 1, "min_attainment": 1.5}, "slo.min_attainment: must be a share in (0, 1], got 1.5"),
])
def test_bad_slos_name_their_field(cfg, expected):
    with pytest.raises(SloError) as e:
        parse_slo(cfg)
    assert str(e.value).startswith(expected)
    with pytest.raises(ConfigError) as e:  # the same through the experiment YAML
        validate_config(tiny(slo=cfg))
    assert str(e.value).startswith(expected)


def test_slo_args_and_defaults():
    assert parse_slo_args(["ttft_p99_s=0.5,tpot_p50_s=0.05", "e2e_s=30"]) == {
        "ttft_p99_s": "0.5", "tpot_p50_s": "0.05", "e2e_s": "30"}
    with pytest.raises(SloError, match="--slo 'ttft': expected NAME=SECONDS"):
        parse_slo_args(["ttft"])
    spec = parse_slo({"ttft_p99_s": "0.5", "e2e_s": 30})
    assert spec.min_attainment == 0.9 and spec.to_dict() == {"ttft_p99_s": 0.5, "e2e_s": 30.0, "min_attainment": 0.9}
    # without explicit deadlines, goodput counts requests within the tightest percentile limit per metric
    spec = parse_slo({"ttft_p99_s": 0.5, "ttft_p50_s": 0.2, "ttft_mean_s": 0.1, "itl_p99_s": 0.1})
    assert [(d.metric, d.limit_s) for d in spec.goodput_deadlines()] == [("ttft", 0.2)]


def _requests(ttft, tpot, e2e):
    return pd.DataFrame({"ttft_s": ttft, "tpot_s": tpot, "e2e_s": e2e})


def test_attainment_goodput_and_binding():
    # 10 requests: TTFT 0.1..1.0 s; the last one never finished (no TTFT / E2E)
    ttft = [0.1 * i for i in range(1, 10)] + [None]
    e2e = [1.0] * 9 + [None]
    tpot = [0.01] * 8 + [None, None]  # request 9 had one output token (finished, no TPOT)
    reqs = _requests(ttft, tpot, e2e)
    ev = evaluate_slo(parse_slo({"ttft_p50_s": 0.65, "tpot_p99_s": 0.005, "ttft_s": 0.45, "tpot_s": 0.02}),
                      reqs, [0.01, 0.02], duration_s=2.0)
    checks = {c["name"]: c for c in ev["checks"]}
    assert checks["ttft_p50_s"]["value"] == pytest.approx(0.5) and checks["ttft_p50_s"]["met"]
    assert checks["ttft_p50_s"]["attainment"] == pytest.approx(0.6)  # 6 of 10 requests within 0.65 s
    assert not checks["tpot_p99_s"]["met"] and checks["tpot_p99_s"]["ratio"] == pytest.approx(2.0)
    assert checks["ttft_s"]["attainment"] == pytest.approx(0.4)
    assert checks["tpot_s"]["attainment"] == pytest.approx(0.9)  # the one-token request meets it, the lost one not
    assert ev["good_requests"] == 4 and ev["attainment"] == pytest.approx(0.4)
    assert ev["goodput_req_s"] == pytest.approx(2.0)
    assert not checks["attainment"]["met"] and checks["attainment"]["ratio"] == pytest.approx(6.0)  # 0.6 / 0.1
    assert ev["binding"] == "attainment" and ev["met"] is False


def test_miss_ratio():
    assert miss_ratio(1.0, 0.9) == 0 and miss_ratio(0.9, 0.9) == pytest.approx(1) and miss_ratio(0.8, 0.9) > 1
    assert miss_ratio(1.0, 1.0) == 0 and miss_ratio(0.99, 1.0) == math.inf


def test_t_statistics_match_the_tables():
    # two-sided 95% t critical values (standard tables)
    for df, t in [(1, 12.7062), (2, 4.3027), (3, 3.1824), (9, 2.2622), (30, 2.0423)]:
        assert t_quantile(0.975, df) == pytest.approx(t, abs=1e-4)
    assert t_quantile(0.9, 3) == pytest.approx(1.6377, abs=1e-4)
    assert t_quantile(0.1, 3) == pytest.approx(-1.6377, abs=1e-4)
    s = mean_ci([1, 2, 3, 4, None, float("nan")])
    assert s["n"] == 4 and s["mean"] == 2.5 and s["ci_hi"] - 2.5 == pytest.approx(3.1824 * 1.29099 / 2, rel=1e-4)
    assert mean_ci([3.0])["ci_lo"] is None and mean_ci([])["mean"] is None
    two = mean_ci([1.0, 9.0])  # two seeds far apart: the t interval would reach -20
    assert two["ci_lo"] == 0.0 and two["ci_hi"] > 9 and mean_ci([1.0, 9.0], within=(None, None))["ci_lo"] < -20
    assert mean_ci([0.5, 1.0], within=(0.0, 1.0))["ci_hi"] == 1.0  # a share stays within [0, 1]
    assert mean_bound([1, 2, 3, 4], 0.9) == pytest.approx(2.5 + 1.6377 * 1.29099 / 2, rel=1e-4)
    assert mean_bound([1, 2, 3, 4], 0.9, upper=False) < 2.5


def test_seeds_in_the_config():
    exp = validate_config(tiny(seed=5, seeds=3))
    assert seeds_for(exp) == [5, 6, 7] and seeds_for(exp, 2) == [5, 6]
    assert validate_config(tiny(seeds=[0, 4])).seeds == [0, 4]
    for bad, msg in [([1, 1], "seeds: duplicate"), ([], "seeds: must be a non-empty list"), (0, "seeds: a count"),
                     ([-1], "seeds[0]: must be an integer >= 0")]:
        with pytest.raises(ConfigError, match=msg.replace("[", r"\[")):
            validate_config(tiny(seeds=bad))
    raw = with_seed(tiny(seeds=[1, 2], workload__seed=9), 2)
    assert raw["seed"] == 2 and raw["workload"]["seed"] == 2 and "seeds" not in raw
