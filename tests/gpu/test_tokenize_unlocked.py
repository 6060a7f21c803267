"""The server's /tokenize and /detokenize call a fast tokenizer's Rust batch API (it releases the GIL, so
a multi-megabyte text does not stall the event loop from the tokenizer thread); the ids and the text
must be exactly what `tokenizer.encode` / `decode` give (issue 27, item 3)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servetwin.core.entrypoints.openai.serving_tokenization import decode_ids, encode_text
from servetwin.gpu.models.registry import load_tokenizer, resolve_model

TEXT = st.lists(st.sampled_from(["a", "b", " ", "  ", "\n", "\t", "7", "é", "🙂", "'s", ",", "<s>", "</s>",
                                 "<|im_end|>", "Hello"]), max_size=20).map("".join)


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2"])
def tok(request):
    return load_tokenizer(resolve_model(request.param))


@settings(max_examples=60, deadline=None)
@given(text=TEXT, special=st.booleans(), ids=st.lists(st.integers(0, 255), max_size=30))
def test_the_rust_batch_calls_equal_encode_and_decode(tok, text, special, ids):
    assert encode_text(tok, text, special) == tok.encode(text, add_special_tokens=special)
    assert decode_ids(tok, ids) == tok.decode(ids)
