"""Prefix-cache hashing: NONE_HASH, hash_block_tokens, extra keys, the request block hasher (docs/scheduler_behaviour.md §4.1-4.3)."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servetwin.core.kv_cache import hashing
from servetwin.core.config_error import ConfigError
from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.kv_cache.hashing import (HASH_ALGOS, NONE_HASH, builtin, generate_block_hash_extra_keys, get_block_hash, get_group_id, get_hash_fn_by_name, get_request_block_hasher, hash_block_tokens, make_block_hash_with_group_id, make_none_hash, sha256)
from servetwin.core.prompt_memo import PromptMemo
from servetwin.core.request import Request
from servetwin.core.sampling_params import SamplingParams
from servetwin.core.sched.config import CacheConfig

from coretest_utils import make_request


def _sha(obj) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def test_sha256_is_sha256_of_pickle():
    obj = (b"parent", (1, 2, 3), None)
    assert sha256(obj) == _sha(obj)
    assert get_hash_fn_by_name("sha256") is sha256
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        get_hash_fn_by_name("md5")


def test_none_hash_fixed_seed_without_pythonhashseed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert make_none_hash(sha256) == _sha("vllm-none-hash")
    assert make_none_hash(sha256) == make_none_hash(sha256)  # stable across re-init


def test_none_hash_uses_pythonhashseed(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    assert make_none_hash(sha256) == _sha("1234")
    assert make_none_hash(sha256) != _sha("vllm-none-hash")


def test_module_none_hash_matches_environment():
    assert NONE_HASH == make_none_hash(sha256)


def test_hash_block_tokens():
    parent = b"p" * 32
    tokens = [1, 2, 3]
    assert hash_block_tokens(sha256, parent, tokens, None) == _sha((parent, (1, 2, 3), None))
    extra = (("cache_salt", "s"),)
    assert hash_block_tokens(sha256, parent, tuple(tokens), extra) == _sha((parent, (1, 2, 3), extra))
    # the first block chains from NONE_HASH
    assert hash_block_tokens(sha256, None, tokens) == _sha((hashing.NONE_HASH, (1, 2, 3), None))


def test_group_id_suffix_helpers():
    key = make_block_hash_with_group_id(b"abc", 7)
    assert key == b"abc" + (7).to_bytes(4, "big")
    assert get_block_hash(key) == b"abc" and get_group_id(key) == 7


def test_extra_keys_none_without_lora_or_salt():
    req = make_request("r", list(range(8)))
    assert generate_block_hash_extra_keys(req, 0) is None
    assert generate_block_hash_extra_keys(req, 4) is None


def test_extra_keys_cache_salt_only_in_first_block():
    req = make_request("r", list(range(8)), cache_salt="salty")
    assert generate_block_hash_extra_keys(req, 0) == (("cache_salt", "salty"),)
    assert generate_block_hash_extra_keys(req, 4) is None


def test_extra_keys_lora_in_every_block_then_salt():
    lora = SimpleNamespace(lora_name="adapter", lora_path="/p/adapter")
    req = make_request("r", list(range(8)), lora_request=lora, cache_salt="s")
    assert generate_block_hash_extra_keys(req, 0) == (("lora", "adapter", "/p/adapter"), ("cache_salt", "s"))
    assert generate_block_hash_extra_keys(req, 4) == (("lora", "adapter", "/p/adapter"),)


def test_request_block_hasher_chains_full_blocks():
    prompt = [0, 1, 2, 3, 4, 5]
    req = make_request("r", prompt, block_size=3)
    h0 = hash_block_tokens(sha256, None, [0, 1, 2])
    h1 = hash_block_tokens(sha256, h0, [3, 4, 5])
    assert req.block_hashes == [h0, h1]
    # a partial block is not hashed
    req2 = make_request("r2", prompt[:5], block_size=3)
    assert req2.block_hashes == [h0]


def test_request_block_hasher_incremental_on_append():
    req = make_request("r", [7, 7, 7, 7, 7], block_size=4)
    assert len(req.block_hashes) == 1
    first = list(req.block_hashes)
    req.append_output_token_ids(8)
    req.append_output_token_ids(9)
    assert req.block_hashes == first  # 7 tokens: still one full block
    req.append_output_token_ids(10)  # 8 tokens: second block full
    assert req.block_hashes[0] == first[0]
    assert req.block_hashes[1] == hash_block_tokens(sha256, first[0], [7, 8, 9, 10])
    req.append_output_token_ids([1, 2, 3, 4, 5])  # list append: 13 tokens -> 3 full blocks
    assert len(req.block_hashes) == 3
    assert req.block_hashes[2] == hash_block_tokens(sha256, req.block_hashes[1], [1, 2, 3, 4])
    # the closure alone returns only the hashes not computed yet
    hasher = get_request_block_hasher(4, sha256)
    assert hasher(req) == []


def test_request_block_hasher_equals_full_rehash():
    tokens = [(i * 37) % 11 for i in range(50)]
    req = make_request("r", tokens[:9], max_tokens=100, block_size=4)
    for t in tokens[9:]:
        req.append_output_token_ids(t)
    fresh = make_request("f", tokens, block_size=4)
    assert req.block_hashes == fresh.block_hashes
    assert len(req.block_hashes) == 12


def test_request_block_hasher_incremental_without_explicit_hash_block_size():
    hasher = get_request_block_hasher(4, sha256)
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=20), block_hasher=hasher)
    assert req.block_hashes == []
    for t in range(5):
        req.append_output_token_ids(t)
    # 8 tokens with 4-token blocks: two hashes (vLLM's Request calls the hasher after every append)
    assert len(req.block_hashes) == 2


def test_salt_and_lora_name_do_not_collide():
    prompt = list(range(8))
    lora = SimpleNamespace(lora_name="x", lora_path="/x")
    with_lora = make_request("a", prompt, lora_request=lora, block_size=4)
    with_salt = make_request("b", prompt, cache_salt="x", block_size=4)
    plain = make_request("c", prompt, block_size=4)
    assert with_lora.block_hashes[0] != with_salt.block_hashes[0]
    assert len({with_lora.block_hashes[1], with_salt.block_hashes[1], plain.block_hashes[1]}) == 3


def test_lora_path_change_changes_block_hashes():
    prompt = list(range(8))
    a = make_request("a", prompt, lora_request=SimpleNamespace(lora_name="l", lora_path="/v1"), block_size=4)
    b = make_request("b", prompt, lora_request=SimpleNamespace(lora_name="l", lora_path="/v2"), block_size=4)
    assert a.block_hashes[0] != b.block_hashes[0] and a.block_hashes[1] != b.block_hashes[1]


def test_salt_separates_every_block_through_chaining():
    prompt = list(range(12))
    a = make_request("a", prompt, cache_salt="s1", block_size=4)
    b = make_request("b", prompt, cache_salt="s2", block_size=4)
    c = make_request("c", prompt, block_size=4)
    same = make_request("d", prompt, cache_salt="s1", block_size=4)
    for i in range(3):
        assert len({a.block_hashes[i], b.block_hashes[i], c.block_hashes[i]}) == 3
    assert a.block_hashes == same.block_hashes


# -- prefix_caching_hash_algo: vLLM's names plus the fast `builtin` ---------------------------------
def _builtin_request(rid, tokens, block_size=4, **kwargs) -> Request:
    sp = SamplingParams(max_tokens=100)
    return Request(rid, tokens, sp, arrival_time=0.0, block_hasher=get_request_block_hasher(block_size, builtin),
                   hash_block_size=block_size, **kwargs)


@pytest.mark.parametrize("extras", [{}, {"cache_salt": "s"},
                                    {"lora_request": SimpleNamespace(lora_name="a", lora_path="/a")}])
def test_builtin_hasher_fast_path_equals_the_generic_chain(extras):
    tokens = [(i * 37) % 1000 for i in range(41)]
    req = _builtin_request("r", tokens[:9], **extras)
    for t in tokens[9:]:
        req.append_output_token_ids(t)
    prev, expected = None, []
    for i in range(10):
        extra = generate_block_hash_extra_keys(req, 4 * i)
        prev = hash_block_tokens(builtin, prev, tokens[4 * i: 4 * i + 4], extra)
        expected.append(prev)
    assert req.block_hashes == expected and all(len(h) == 8 for h in expected)
    assert len(set(expected)) == 10


def test_builtin_hash_is_process_independent():
    """Python randomises str/bytes hashes per process (PYTHONHASHSEED unset: a random seed each, which
    vLLM's NONE_HASH does not depend on then); `builtin` hashes integers only."""
    code = ("from servetwin.core.kv_cache.hashing import builtin, hash_block_tokens as h;"
            "a = h(builtin, None, [1, 2, 3], (('cache_salt', 'x'),)); print(h(builtin, a, [4, 5, 6]).hex())")
    outs = set()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    for _ in range(2):
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True).stdout.strip())
    assert len(outs) == 1


def test_hash_algo_names_and_errors():
    assert get_hash_fn_by_name("builtin") is builtin
    assert set(HASH_ALGOS) == {"sha256", "sha256_cbor", "xxhash", "xxhash_cbor", "builtin"}
    with pytest.raises(ConfigError, match="prefix_caching_hash_algo"):
        CacheConfig(prefix_caching_hash_algo="md5")
    for name, module in (("xxhash", "xxhash"), ("sha256_cbor", "cbor2")):
        if importlib.util.find_spec(module) is None:  # vLLM's optional packages: a clear error naming the field
            with pytest.raises(ConfigError, match=f"prefix_caching_hash_algo.*{module}"):
                CacheConfig(prefix_caching_hash_algo=name)
        else:
            assert CacheConfig(prefix_caching_hash_algo=name).prefix_caching_hash_algo == name
    assert EngineArgs.from_kwargs(backend="sim", prefix_caching_hash_algo="builtin").cache_config() \
        .prefix_caching_hash_algo == "builtin"


@pytest.mark.pure_python("patches a module global of the scheduler")
@pytest.mark.parametrize("name", ["b_shared_prefix", "b2_shared_prefix_async", "d_abort_running_00"])
def test_recorded_replays_take_the_same_decisions_with_builtin(name, monkeypatch):
    """Decisions depend on hash equality only: every replayed step equals the sha256 replay (which
    test_core_replay checks against vLLM's recording)."""
    from servetwin.core.sched import scheduler as scheduler_module
    from servetwin.core.testbed.replay import replay
    from servetwin.core.testbed.scenario import load_scenario

    path = str(Path(__file__).parent / "data" / f"{name}.json")
    reference = list(replay(load_scenario(path)))
    calls = []

    def counted(obj):
        calls.append(1)
        return builtin(obj)
    monkeypatch.setattr(scheduler_module, "get_hash_fn_by_name", lambda _name: counted)
    assert list(replay(load_scenario(path))) == reference
    assert calls  # the replay hashed its blocks with it


@settings(max_examples=120, deadline=None)
@given(block_size=st.integers(1, 5), prompt=st.lists(st.integers(0, 9), min_size=1, max_size=14),
       appends=st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=6), max_size=6),
       algo=st.sampled_from(["sha256", "builtin"]), memo=st.booleans(), again=st.booleans())
def test_request_hashes_from_prompt_and_output_lists_equal_the_chain_over_all_tokens(
        block_size, prompt, appends, algo, memo, again):
    """A `Request`'s hasher reads a block's tokens from its prompt and output lists (`get_token_ids`, blocks
    across the boundary included; `all_token_ids` is not built): the hashes equal the chain of
    `hash_block_tokens` over all its tokens, and those of a request-like probe that holds one token list."""
    hash_fn = get_hash_fn_by_name(algo)
    hasher = get_request_block_hasher(block_size, hash_fn, prompt_memo=PromptMemo() if memo else None)
    for rid in ("r", "again")[:1 + again]:  # the same prompt list again: its prompt hashes from the memo
        req = Request(rid, prompt, SamplingParams(max_tokens=100), arrival_time=0.0, block_hasher=hasher,
                      hash_block_size=block_size)
        tokens = list(prompt)
        for out in appends:
            req.append_output_token_ids(out)
            tokens += out
        prev, expected = None, []
        for start in range(0, len(tokens) - block_size + 1, block_size):
            prev = hash_block_tokens(hash_fn, prev, tokens[start:start + block_size])
            expected.append(prev)
        assert req.block_hashes == expected and req._all_token_ids is None
        probe = SimpleNamespace(block_hashes=[], all_token_ids=tokens, lora_request=None, cache_salt=None)
        assert hasher(probe) == expected
