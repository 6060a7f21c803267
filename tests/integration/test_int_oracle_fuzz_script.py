"""scripts/oracle_fuzz.py without vLLM: its scenarios are reproducible from (seed, index) and accepted by
servetwin's replay; its comparison is the replay test's; its loop, with a stand-in driver in the worker
process (servetwin's own replay, perturbed on demand), counts, saves and shrinks divergences."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

import servetwin
from servetwin.core.testbed.replay import replay
from servetwin.core.testbed.scenario import load_scenario

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "core" / "data"


def _load_fuzz():
    spec = importlib.util.spec_from_file_location("servetwin_oracle_fuzz", REPO / "scripts" / "oracle_fuzz.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


fuzz = _load_fuzz()

# A driver with the oracle drivers' interface (run / ensure_model_dir) that writes servetwin's own replay,
# in the oracle's format (`effective.max_model_len` on the config line, `finished` as pairs); PERTURB makes every scenario of two or more
# requests differ (one more step in the summary), so the shrinker must stop at two requests.
STAND_IN = '''
import json, sys
sys.path.insert(0, {root!r})
from servetwin.core.testbed.replay import replay
from servetwin.core.testbed.scenario import parse_scenario
PERTURB = {perturb!r}

def ensure_model_dir(path):
    return path

def run(scenario, model_dir, out):
    for line in replay(parse_scenario(scenario)):
        if line["type"] == "config":
            line.setdefault("effective", {{}})["max_model_len"] = line["settings"]["max_model_len"]
        if line["type"] == "step" and "finish_reasons" in line:  # the oracle writes [id, reason] pairs
            line["finished"] = [[r, line["finish_reasons"][r]] for r in line["finished"]]
        if line["type"] == "summary" and PERTURB and len(scenario["requests"]) >= 2:
            line["num_steps"] += 1
        out.write(json.dumps(line) + "\\n")
'''


def test_scenarios_are_reproducible_and_accepted_by_the_replay():
    families = list(fuzz.DEFAULT_FAMILIES)
    seen, layouts = set(), set()
    for i in range(120):
        family, scenario = fuzz.generate(11, i, families)
        assert fuzz.generate(11, i, families) == (family, scenario)
        seen.add(family)
        groups = scenario["settings"].get("kv_cache_groups")
        if groups:
            layouts.add(tuple(sorted({g["type"] for g in groups})))
        status, lines = fuzz.run_ours(scenario)
        assert status == "ok", (i, family, lines)  # servable by construction: never "rejected"
        assert lines[0]["type"] == "config" and lines[-1]["type"] == "summary"
    assert seen == set(families)
    assert {("full_attention", "sliding_window"), ("sliding_window",)} <= layouts
    assert any("chunked_local_attention" in kinds for kinds in layouts)


def test_big_connector_and_spec_families():
    _, big = fuzz.generate(3, 0, ["big"])
    assert len(big["requests"]) >= 12 and fuzz.run_ours(big)[0] == "ok"
    _, k = fuzz.generate(3, 0, ["k"])
    _, s = fuzz.generate(3, 0, ["s"])
    assert "kv_connector" in k["settings"] and "speculative" in s["settings"]


def test_first_difference_compares_as_the_replay_test():
    keys = fuzz._load_replay_test()
    name = "h_tight_async"
    expected = [json.loads(x) for x in (DATA / f"{name}.expected.jsonl").read_text().splitlines() if x.strip()]
    ours = json.loads(json.dumps(list(replay(load_scenario(str(DATA / f"{name}.json"))))))
    assert fuzz.first_difference(expected, ours, keys) is None
    bad = json.loads(json.dumps(expected))
    step = next(line for line in bad if line.get("num_scheduled_tokens"))
    rid = next(iter(step["num_scheduled_tokens"]))
    step["num_scheduled_tokens"][rid] += 1
    assert f"step {step['step']}.num_scheduled_tokens" in fuzz.first_difference(bad, ours, keys)
    assert "line types differ" in fuzz.first_difference(expected[:-2] + expected[-1:], ours, keys)


def _stand_in(tmp_path: Path, perturb: bool) -> Path:
    path = tmp_path / "stand_in_driver.py"
    root = str(Path(servetwin.__file__).parent.parent)  # where `import servetwin` finds this checkout
    path.write_text(STAND_IN.format(root=root, perturb=perturb))
    return path


@pytest.mark.parametrize("perturb", [False, True])
def test_the_loop_counts_saves_and_shrinks(tmp_path, capsys, perturb):
    out = tmp_path / "out"
    rc = fuzz.main(["--vllm-python", sys.executable, "--driver", str(_stand_in(tmp_path, perturb)), "-o", str(out),
                    "--families", "sync,hybrid", "--seed", "2", "--count", "5", "--shrink", "--shrink-tries", "40"])
    assert rc == 0
    counts = json.loads((out / "counts.json").read_text())
    assert counts["total"]["tried"] == 5
    assert sum(c["tried"] for c in counts["per_family"].values()) == 5
    if not perturb:
        assert counts["total"].get("agree") == 5 and counts["diverged"] == []
        return
    diverged = counts["diverged"]
    assert diverged and counts["total"].get("diverge") == len(diverged)
    for d in diverged:
        assert "summary.num_steps" in d["difference"]
        assert d["min_requests"] == 2  # one request no longer differs
        saved = out / "diverged" / d["name"]
        assert Path(f"{saved}.json").exists() and Path(f"{saved}.expected.jsonl").exists()
        small = json.loads(Path(f"{saved}.min.json").read_text())
        assert len(small["requests"]) == 2
    assert "DIVERGED" in capsys.readouterr().out


def test_recheck_reports_what_still_differs(tmp_path, capsys):
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "c_tight_kv.json").write_text((DATA / "c_tight_kv.json").read_text())
    (saved / "one.json").write_text(json.dumps({  # one request: the perturbing stand-in agrees
        "settings": {"max_num_seqs": 2, "max_num_batched_tokens": 32, "num_gpu_blocks": 8, "block_size": 4},
        "requests": [{"id": "r0", "prompt_token_ids": list(range(1, 11)), "max_tokens": 3}]}))
    args = ["--vllm-python", sys.executable, "-o", str(tmp_path / "o"), "--recheck", str(saved)]
    assert fuzz.main(args + ["--driver", str(_stand_in(tmp_path, False))]) == 0
    assert fuzz.main(args + ["--driver", str(_stand_in(tmp_path, True))]) == 1  # c_tight_kv has 4 requests
    assert "1 still differ" in capsys.readouterr().out.splitlines()[-1]


def test_bad_flags_are_usage_errors(tmp_path):
    base = ["--vllm-python", sys.executable, "--driver", str(_stand_in(tmp_path, False)), "-o", str(tmp_path)]
    for argv in (base + ["--families", "sync,bogus", "--count", "1"], base,
                 ["--vllm-python", "/nonexistent/python", "--driver", "x.py", "-o", str(tmp_path), "--count", "1"]):
        with pytest.raises(SystemExit) as info:
            fuzz.main(argv)
        assert info.value.code == 2
