"""The block hashers' LRU cache of vLLM's hash functions (`cached_hash_fn`): every block hash the cached
hasher returns is the hash function's own value, whatever was cached before (shared prefixes, resent
prompts, extra keys, lookahead hashes, evictions)."""
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servetwin.core.kv_cache import hashing
from servetwin.core.kv_cache.hashing import (NONE_HASH, builtin, cached_hash_fn, generate_block_hash_extra_keys,
                                             get_request_block_hasher, sha256)
from servetwin.core.request import Request
from servetwin.core.sampling_params import SamplingParams


def _reference(tokens, block_size, lookahead=0, salt=None, lora=None):
    """The chain with the uncached sha256: (parent, block tokens, extra keys) per full block."""
    req = SimpleNamespace(cache_salt=salt, lora_request=lora)
    out, prev = [], NONE_HASH
    for start in range(0, len(tokens) - lookahead - block_size + 1, block_size):
        end = start + block_size
        extra = generate_block_hash_extra_keys(req, start)
        if lookahead:
            extra = (extra, *tokens[end:end + lookahead])
        prev = sha256((prev, tuple(tokens[start:end]), extra))
        out.append(prev)
    return out


_prefix = st.lists(st.integers(0, 5), max_size=12)


@settings(max_examples=120, deadline=None)
@given(prefixes=st.lists(_prefix, min_size=1, max_size=3),
       prompts=st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(0, 5), max_size=8),
                                  st.lists(st.integers(0, 5), max_size=8)), min_size=1, max_size=8),
       block_size=st.integers(1, 4), lookahead=st.sampled_from([0, 0, 2]),
       salt=st.sampled_from([None, "s"]), lora=st.booleans(), cache_size=st.sampled_from([2, 1 << 14]))
def test_cached_hasher_returns_the_hash_functions_values(prefixes, prompts, block_size, lookahead, salt, lora,
                                                         cache_size):
    size, cached = hashing.BLOCK_HASH_CACHE_SIZE, dict(hashing._CACHED_HASH_FNS)
    hashing.BLOCK_HASH_CACHE_SIZE = cache_size  # 2: evictions all the time
    hashing._CACHED_HASH_FNS.clear()
    try:
        _check_requests(prefixes, prompts, block_size, lookahead, salt, lora)
    finally:
        hashing.BLOCK_HASH_CACHE_SIZE = size
        hashing._CACHED_HASH_FNS.clear()
        hashing._CACHED_HASH_FNS.update(cached)


def _check_requests(prefixes, prompts, block_size, lookahead, salt, lora):
    lora_request = SimpleNamespace(lora_name="l", lora_path="/l") if lora else None
    hasher = get_request_block_hasher(block_size, sha256, lookahead)
    for i, (g, suffix, output) in enumerate(prompts):
        prompt = prefixes[g % len(prefixes)] + suffix  # shared prefixes, resent prompts
        if not prompt:
            continue
        req = Request(f"r{i}", prompt, SamplingParams(max_tokens=100), arrival_time=0.0, cache_salt=salt,
                      lora_request=lora_request, block_hasher=hasher, hash_block_size=block_size)
        for token in output:  # decode blocks hashed as they fill
            req.append_output_token_ids(token)
        assert req.block_hashes == _reference(prompt + output, block_size, lookahead, salt, lora_request)


def test_only_vllms_hash_functions_are_cached():
    assert cached_hash_fn(builtin) is builtin  # (cheaper than a lookup)
    calls = []

    def counting(obj):
        calls.append(obj)
        return sha256(obj)
    assert cached_hash_fn(counting) is counting  # maybe impure: every call reaches it
    assert cached_hash_fn(sha256) is cached_hash_fn(sha256) is not sha256  # one cache per function
    key = (NONE_HASH, (1, 2, 3), None)
    assert cached_hash_fn(sha256)(key) == sha256(key)


@pytest.mark.parametrize("algo", ["sha256", "builtin"])
def test_hasher_of_each_algorithm_equals_the_plain_chain(algo):
    fn = hashing.get_hash_fn_by_name(algo)
    hasher = get_request_block_hasher(4, fn)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    for _ in range(2):  # the second time from the cache
        req = Request("r", prompt, SamplingParams(max_tokens=10), arrival_time=0.0, block_hasher=hasher,
                      hash_block_size=4)
        prev, want = NONE_HASH, []
        for start in (0, 4):
            prev = fn((prev, tuple(prompt[start:start + 4]), None))
            want.append(prev)
        assert req.block_hashes == want
