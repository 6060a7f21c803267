"""`servetwin presets`: every preset listed with figures that match the published model sizes."""
import json

from servetwin.experiments.cli import main


def test_presets_json_lists_models_with_their_published_sizes(capsys):
    assert main(["presets", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    models = {m["name"]: m for m in out["models"]}
    # parameter counts the configs imply (the model names round them)
    for name, billions in {"qwen3-14b": 14.8, "qwen3-32b": 32.8, "mistral-7b": 7.25, "llama-3.1-405b": 405.9,
                           "llama-3.1-8b": 8.03}.items():
        assert abs(models[name]["params_b"] - billions) < 0.06, name
    assert models["llama-3.1-405b"]["kv_kib_per_token"] == 126 * 2 * 8 * 128 * 2 / 1024
    assert "mistralai/mistral-7b-instruct-v0.3" in models["mistral-7b"]["aliases"]
    assert {h["name"] for h in out["hardware"]} >= {"h100-sxm", "h200", "cpu"}


def test_presets_table(capsys):
    assert main(["presets", "models"]) == 0
    text = capsys.readouterr().out
    assert "qwen3-32b" in text and "hardware" not in text.split("\n")[2]


def test_presets_state_each_models_kv_cache_groups(capsys):
    assert main(["presets", "--json"]) == 0
    models = {m["name"]: m for m in json.loads(capsys.readouterr().out)["models"]}
    assert models["gpt-oss-120b"]["kv_cache_groups"] == (
        "sliding_window 128 + full_attention (2 KV cache groups x 18 layers)")
    assert models["llama-3.1-8b"]["kv_cache_groups"] == "full_attention (1 KV cache group x 32 layers)"


def test_presets_say_what_each_hardware_was_validated_on(capsys, tmp_path):
    assert main(["presets", "--json"]) == 0
    hw = {h["name"]: h for h in json.loads(capsys.readouterr().out)["hardware"]}
    assert hw["b200"]["calibrated"] is False and "16-19% slow" in hw["b200"]["validated_on"]
    assert hw["h100-sxm"]["calibrated"] is True and hw["h200"]["calibrated"] is False
    assert main(["presets", "hardware"]) == 0
    text = capsys.readouterr().out
    assert "fitted on its runs" in text and "b200: not fitted" in text and "True" not in text
    # a run on a preset not fitted on its own GPU's runs says so
    from exptest_helpers import tiny, write_yaml

    cfg = write_yaml(tmp_path / "c.yaml", tiny(hardware="b200", workload__requests=3))
    assert main(["run", str(cfg), "-o", str(tmp_path / "out"), "--no-progress", "--no-plots"]) == 0
    err = capsys.readouterr().err
    assert "note: hardware 'b200' is not fitted on a run of its own GPU" in err and "16-19% slow" in err
    assert main(["run", str(write_yaml(tmp_path / "h.yaml", tiny(hardware="h100-sxm", workload__requests=3))),
                 "-o", str(tmp_path / "h"), "--no-progress", "--no-plots"]) == 0
    assert "not fitted" not in capsys.readouterr().err
