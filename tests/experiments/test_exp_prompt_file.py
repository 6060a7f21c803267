"""`workload.prompts`: real prompts from a JSONL file, tokenized with the model's tokenizer (the `make run`
workload), their checks, and the answers the torch backend writes for them."""
import json

import pytest
from exptest_helpers import CONFIGS, tiny

from servetwin.core.config_error import ConfigError
from servetwin.experiments.config.prompt_file import (PromptRecord, answer_text, load_prompt_file,
                                                      tokenize_prompts)
from servetwin.experiments.config.schema import validate_config
from servetwin.experiments.config.workloads import build_requests


def _write(tmp_path, lines) -> str:
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return str(path)


class FakeTokenizer:
    """Characters as tokens: a chat renders as `role: content` lines plus the generation prompt."""
    eos_token_id = 0

    def apply_chat_template(self, chat, add_generation_prompt, tokenize):
        assert add_generation_prompt and not tokenize
        return "".join(f"{m['role']}: {m['content']}\n" for m in chat) + "assistant:"

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_records_are_read_with_their_defaults(tmp_path):
    path = _write(tmp_path, ["# a comment", "", {"prompt": "hi", "max_tokens": 3},
                             {"id": "c", "messages": [{"role": "user", "content": "yo"}]}])
    recs = load_prompt_file(path, default_max_tokens=7)
    assert recs == [PromptRecord("p3", 3, prompt="hi"), PromptRecord("c", 7, messages=(("user", "yo"),))]
    assert [r.text_for_report() for r in recs] == ["hi", "yo"]


@pytest.mark.parametrize("line,needle", [
    ("{not json", "line 1: not valid JSON"),
    ([1, 2], "line 1: each line must be a JSON object, got list"),
    ({"prompt": "a", "max_tokens": 2, "temperature": 1}, "unknown key 'temperature'"),
    ({"prompt": "a", "messages": [], "max_tokens": 2}, "exactly one of 'messages' (a chat) or 'prompt'"),
    ({"max_tokens": 2}, "exactly one of"),
    ({"prompt": "", "max_tokens": 2}, "line 1.prompt: must be a non-empty string"),
    ({"prompt": "a"}, "line 1.max_tokens: missing"),
    ({"prompt": "a", "max_tokens": 0}, "line 1.max_tokens: must be an integer >= 1, got 0"),
    ({"prompt": "a", "max_tokens": True}, "must be an integer >= 1, got True"),
    ({"messages": [{"role": "user"}], "max_tokens": 2}, "line 1.messages[0]: must be an object with string"),
    ({"messages": "hi", "max_tokens": 2}, "line 1.messages: must be a non-empty list"),
    ({"id": 3, "prompt": "a", "max_tokens": 2}, "line 1.id: must be a non-empty string"),
])
def test_a_bad_line_names_the_file_the_line_and_the_field(tmp_path, line, needle):
    path = _write(tmp_path, [line])
    with pytest.raises(ConfigError) as e:
        load_prompt_file(path)
    assert e.value.path == "workload.prompts" and needle in e.value.message and path in e.value.message


def test_duplicate_ids_and_empty_files_are_refused(tmp_path):
    path = _write(tmp_path, [{"id": "a", "prompt": "x", "max_tokens": 1}, {"id": "a", "prompt": "y", "max_tokens": 1}])
    with pytest.raises(ConfigError, match="line 2: id 'a' is used by an earlier line"):
        load_prompt_file(path)
    with pytest.raises(ConfigError, match="no prompts"):
        load_prompt_file(_write(tmp_path, ["# nothing"]))


def test_chats_use_the_template_without_extra_special_tokens_and_text_the_tokenizer_defaults():
    recs = [PromptRecord("c", 2, messages=(("user", "ab"),)), PromptRecord("t", 2, prompt="ab")]
    chat, text = tokenize_prompts(recs, FakeTokenizer())
    assert chat == [ord(c) for c in "user: ab\nassistant:"]  # no BOS added twice
    assert text == [1, ord("a"), ord("b")]


def test_an_answer_is_shown_up_to_its_first_eos():
    tok = FakeTokenizer()
    assert answer_text(tok, [ord("o"), ord("k"), 0, ord("x")], [0]) == ("ok", True)
    assert answer_text(tok, [ord("o"), ord("k")], [0]) == ("ok", False)


def test_the_workload_section_checks_its_neighbours(tmp_path):
    path = _write(tmp_path, [{"prompt": "a", "max_tokens": 2}])
    for extra, needle in (({"scenario": path}, "workload.prompts: not allowed together with workload.scenario"),
                          ({"prompt_tokens": 5}, "workload.prompt_tokens: not allowed with workload.prompts"),
                          ({"output_tokens": {"type": "uniform", "low": 1, "high": 3}},
                           "workload.output_tokens: with workload.prompts: a constant integer"),
                          ({"priority": {"type": "uniform"}}, "workload.priority: not allowed with workload.prompts")):
        cfg = tiny(workload={"prompts": path, **extra})
        with pytest.raises(ConfigError) as e:
            validate_config(cfg)
        assert needle in str(e.value)
    exp = validate_config(tiny(workload={"prompts": path, "output_tokens": 4, "requests": 1}))
    assert exp.workload.source == "prompts" and exp.workload.prompts[0].max_tokens == 2


def test_requests_are_built_from_the_tokenized_prompts_in_file_order(tmp_path, monkeypatch):
    from servetwin.experiments.config import prompt_file

    monkeypatch.setattr(prompt_file, "model_tokenizer", lambda model, where="workload.prompts": FakeTokenizer())
    path = _write(tmp_path, [{"id": "x", "prompt": "hi", "max_tokens": 2}, {"id": "y", "prompt": "hey", "max_tokens": 5}])
    exp = validate_config(tiny(workload={"prompts": path, "arrival": {"type": "poisson", "rate": 2.0}}))
    requests, _, _ = build_requests(exp, vocab_size=256)
    assert [(r.request_id, r.prompt_token_ids, r.max_tokens) for r in requests] == [
        ("x", [1, 104, 105], 2), ("y", [1, 104, 101, 121], 5)]
    assert 0 < requests[0].arrival_s < requests[1].arrival_s
    with pytest.raises(ConfigError, match="token id 121 is outside the model's vocabulary"):
        build_requests(exp, vocab_size=120)


def test_a_model_without_a_tokenizer_is_named():
    from servetwin.experiments.config.prompt_file import model_tokenizer

    with pytest.raises(ConfigError, match="text prompts need the tokenizer of model 'no-such-model'"):
        model_tokenizer("no-such-model")


def test_answers_section_of_the_report():
    from servetwin.experiments.run.report import answers_markdown

    assert answers_markdown(None) == []
    md = "\n".join(answers_markdown([{"id": "a", "prompt": "Why?\n  Because", "answer": "Line one\nLine two",
                                      "ended_by_eos": False, "output_tokens": 9}]))
    assert "**a**: Why? Because" in md and "> Line one\n> Line two" in md and "no EOS within 9 tokens" in md


def test_the_make_run_prompts_are_real_chats_sharing_a_system_prompt():
    recs = load_prompt_file(str(CONFIGS / "prompts" / "default_chat.jsonl"))
    systems = [r.messages[0][1] for r in recs if r.messages and r.messages[0][0] == "system"]
    assert len(recs) == 42 and len(systems) >= 24 and len(set(systems)) == 1
    assert {r.max_tokens for r in recs} >= {24, 128}


def test_a_torch_run_of_text_prompts_writes_every_answer_and_the_report_shows_them(tmp_path):
    from servetwin.experiments.run.experiment import run_experiment

    path = _write(tmp_path, [{"id": "c", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 5},
                             {"id": "t", "prompt": "Once upon a time", "max_tokens": 3}])
    cfg = tiny(backends=["sim", "torch"], engine__device="cpu", workload={"prompts": path})
    exp = validate_config(cfg, base_dir=tmp_path)
    combined = run_experiment(exp, str(tmp_path / "out"), progress=False, log=lambda m: None)
    assert combined["backends"]["torch"]["output_tokens"] == 8 == combined["backends"]["sim"]["output_tokens"]
    answers = [json.loads(line) for line in (tmp_path / "out" / "torch" / "answers.jsonl").read_text().splitlines()]
    assert [(a["id"], a["output_tokens"], a["prompt"]) for a in answers] == [
        ("c", 5, "Hello there"), ("t", 3, "Once upon a time")]
    assert all(isinstance(a["answer"], str) for a in answers)
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## Answers (torch backend, greedy)" in report and "**t**: Once upon a time" in report
