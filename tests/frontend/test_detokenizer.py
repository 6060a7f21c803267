"""`IncrementalDetokenizer`: the text built token by token equals one decode of all the tokens, stop
strings are found wherever the token boundaries fall, and a step decodes a window, not the output.

Tokenizers: the toy tokenizer, a byte-level BPE (GPT-2 / Llama 3 / Qwen style: multi-byte characters
split over tokens) and a Metaspace BPE with byte fallback (SentencePiece / Llama 2 style: the decoder
strips the leading space of a text), both trained here with `tokenizers` on a few lines."""
from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servetwin.core.engine.detokenizer import IncrementalDetokenizer
from servetwin.core.engine.toy_tokenizer import ToyTokenizer
from servetwin.core.sampling_params import SamplingParams

CORPUS = ["héllo wörld, the quick brown fox jumps over the lazy dog.", "naïve café — 你好 世界 ✓ 🙂 ok",
          "don't stop: it's 3.14 or 2,718; (a) [b] {c} \"quoted\" end\n  indented\tline"] * 3
SPECIALS = ["<s>", "</s>", "<|im_end|>"]


@functools.cache
def trained(kind: str):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "bytelevel":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:  # SentencePiece-like: "▁" for spaces, unknown characters as <0xNN> byte tokens
        tok = Tokenizer(models.BPE(byte_fallback=True, unk_token=None))
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
        trainer = trainers.BpeTrainer(vocab_size=200, show_progress=False,
                                      special_tokens=SPECIALS + [f"<0x{b:02X}>" for b in range(256)])
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


TOKENIZERS = ["toy", "bytelevel", "metaspace"]


def get_tokenizer(kind: str):
    return ToyTokenizer(64) if kind == "toy" else trained(kind)


def token_ids(kind: str):
    """Ids drawn from the vocabulary (incl. special tokens; byte-level: lone bytes too) and from encoded text.

    Metaspace: no lone byte-fallback tokens. `tokenizers`' ByteFallback decoder turns a run of byte
    tokens that is not valid UTF-8 into one U+FFFD per byte, a property of the whole run that no
    incremental decoder (vLLM's included) reproduces; valid runs (encoded text) are drawn."""
    tok = get_tokenizer(kind)
    vocab = list(range(len(tok)))
    if kind == "metaspace":
        vocab = [i for i in vocab if not tok.convert_ids_to_tokens(i).startswith("<0x")]
    raw = st.lists(st.sampled_from(vocab), max_size=40)
    if kind == "toy":
        return raw
    text = st.text(st.sampled_from(sorted(set("".join(CORPUS)) | set("é你🙂\u0301"))), max_size=40)
    encoded = text.map(lambda s: get_tokenizer(kind).encode(s, add_special_tokens=False))
    return st.one_of(raw, encoded, st.tuples(encoded, raw, encoded).map(lambda t: t[0] + t[1] + t[2]))


def chunks(ids: list[int], cuts: list[int]) -> list[list[int]]:
    """Split `ids` into steps at the given cut points (several tokens per step, as with async outputs)."""
    points = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    return [ids[a:b] for a, b in zip(points, points[1:])]


def run(tok, params: SamplingParams, steps: list[list[int]]) -> IncrementalDetokenizer:
    detok = IncrementalDetokenizer(tok, params, [1, 2, 3])
    for step in steps:
        if detok.update(step):
            break
    else:  # the request ends: held-back text is flushed (and checked for stop strings) as at a finish
        detok.flush()
    return detok


@pytest.mark.parametrize("kind", TOKENIZERS)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_incremental_text_equals_one_full_decode(kind, data):
    tok = get_tokenizer(kind)
    ids = data.draw(token_ids(kind))
    cuts = data.draw(st.lists(st.integers(0, 64), max_size=8))
    skip = data.draw(st.booleans())
    detok = run(tok, SamplingParams(max_tokens=None, skip_special_tokens=skip), chunks(ids, cuts))
    assert detok.token_ids == ids
    assert detok.visible_text(finished=True) == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("kind", TOKENIZERS)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_stop_strings_are_found_across_token_boundaries(kind, data):
    """The stop string is wherever the full decode has it first (ending first), however the tokens
    and steps split it; the text stops before it (or after it, with include_stop_str_in_output) and
    the tokens after the one that completed it are dropped."""
    tok = get_tokenizer(kind)
    ids = data.draw(token_ids(kind).filter(bool))
    full = tok.decode(ids, skip_special_tokens=True)
    if not full:
        return
    a = data.draw(st.integers(0, len(full) - 1))
    stop = full[a:a + data.draw(st.integers(1, 6))]
    if "\ufffd" in stop:  # a character split over tokens is never part of the streamed text
        return
    other = data.draw(st.sampled_from(["\x00never\x00", stop[::-1] or "x"]))
    include = data.draw(st.booleans())
    params = SamplingParams(max_tokens=None, stop=[stop, other], include_stop_str_in_output=include)
    detok = run(tok, params, chunks(ids, data.draw(st.lists(st.integers(0, 64), max_size=8))))
    # expected: the earliest-ending stop string in the text decoded token by token
    ends = [(full.find(s) + len(s), s) for s in (stop, other) if full.find(s) != -1]
    end, first = min(ends, key=lambda t: t[0])
    idx = end - len(first)
    # the first token whose text completes the stop string is the last one kept; text that ends in an
    # incomplete character is held back until the character completes (vLLM's incremental detokenizer),
    # so a stop string followed by a split character is seen only then
    prefixes = (tok.decode(ids[:k], skip_special_tokens=True) for k in range(1, len(ids) + 1))
    seen = (i for i, text in enumerate(prefixes) if not text.endswith("\ufffd") and text.startswith(full[:end]))
    k = 1 + next(seen, len(ids) - 1)  # never complete: found when the text is flushed at the end
    assert detok.stop_reason is not None
    assert detok.output_text == full[:end if include else idx]
    assert detok.stop_reason in (stop, other) and full[idx:end] == detok.stop_reason
    assert detok.token_ids == ids[:k]


def test_a_step_decodes_a_window_not_the_whole_output():
    """10,000 tokens: each decode call sees a few ids (vLLM's prefix / read offsets), never the output."""
    sizes = []

    class Counting(ToyTokenizer):
        def decode(self, token_ids, skip_special_tokens=True):
            sizes.append(len(token_ids))
            return super().decode(token_ids, skip_special_tokens)

    detok = IncrementalDetokenizer(Counting(64), SamplingParams(max_tokens=None, stop=["never"]), [])
    for i in range(10_000):
        detok.update([i % 64])
    assert len(detok.token_ids) == 10_000 and detok.output_text == ToyTokenizer(64).decode(detok.token_ids)
    assert max(sizes) <= 2 and len(sizes) <= 2 * 10_000


def test_min_tokens_delays_the_stop_string_check():
    tok = ToyTokenizer(64)
    # as in vLLM: checked once the output has more than min_tokens tokens, on the text added since
    detok = run(tok, SamplingParams(max_tokens=None, stop=[" 5"], min_tokens=2), [[5], [6], [5], [7]])
    assert detok.token_ids == [5, 6, 5] and detok.output_text == " 5 6" and detok.stop_reason == " 5"


def test_streaming_holds_back_a_possible_stop_string_prefix():
    tok = ToyTokenizer(64)
    detok = IncrementalDetokenizer(tok, SamplingParams(max_tokens=None, stop=[" 9 9"]), [])
    detok.update([1, 9])  # " 1 9": the last len(stop) - 1 = 3 characters could start the stop string
    assert detok.visible_text(finished=False) == " "
    assert detok.visible_text(finished=True) == " 1 9"
