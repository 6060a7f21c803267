"""Prefix-cache block hashing (vLLM 0.33 `kv_cache_utils.py` + `utils/hashing.py`): a chained hash over
(parent hash, the block's tokens, extra keys); only equality of hashes matters to the decisions.

`prefix_caching_hash_algo` picks the hash function by vLLM's names - `sha256` (the default: SHA-256 of
the pickled tuple, what the recorded vLLM replays are checked with), `sha256_cbor`, `xxhash` and
`xxhash_cbor` (these three need the optional `cbor2` / `xxhash` packages, as in vLLM) - plus `builtin`,
a fast non-cryptographic option for simulated runs (see `builtin`).
"""
from __future__ import annotations

import functools
import hashlib
import os
import pickle
from typing import Any, Callable, Optional

from servetwin.core.prompt_memo import PromptMemo

BlockHash = bytes
HashFn = Callable[[Any], bytes]
NONE_HASH_SEED = "vllm-none-hash"
HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor", "builtin")
_MASK64 = (1 << 64) - 1


def sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def builtin(obj: Any) -> bytes:
    """Python's built-in tuple hash over integers, as 8 bytes: about 3x faster than `sha256` (no
    pickling). vLLM up to 0.9 offered the same idea as `builtin`; here it is process-independent (only
    integers are hashed - a parent hash enters as an int, extra keys as their SHA-256 prefix - and
    Python randomises only str/bytes hashes), so runs are reproducible.

    Not cryptographic: crafted token sequences can collide, so use it for simulated workloads only.
    Collision bound: Python reduces each int modulo 2**61 - 1 and mixes tuple items xxHash-style, so
    the chain carries at most 61 bits; treating it as a random function, the chance that any two of
    n distinct blocks share a hash is at most n**2 / 2**62 (1e6 blocks: 2e-7; 1e7 blocks: 2e-5).
    A collision could only turn a miss into a wrong prefix-cache hit."""
    if type(obj) is not tuple:  # the NONE_HASH seed (a str)
        return sha256(obj)[:8]
    parent, tokens, extra = obj
    key = ((int.from_bytes(parent, "little"), tokens) if extra is None
           else (int.from_bytes(parent, "little"), tokens, int.from_bytes(sha256(extra)[:8], "little")))
    return (hash(key) & _MASK64).to_bytes(8, "little")


def _cbor_dumps(obj: Any) -> bytes:
    try:
        import cbor2  # noqa: PLC0415 (optional, as in vLLM)
    except ImportError as exc:
        raise ValueError("prefix_caching_hash_algo: the '*_cbor' hashes need the cbor2 package "
                         "(pip install cbor2)") from exc
    return cbor2.dumps(obj, canonical=True)


def _xxh3_128(data: bytes) -> bytes:
    try:
        import xxhash  # noqa: PLC0415 (optional, as in vLLM)
    except ImportError as exc:
        raise ValueError("prefix_caching_hash_algo: 'xxhash' and 'xxhash_cbor' need the xxhash package "
                         "(pip install xxhash)") from exc
    return xxhash.xxh3_128_digest(data)


def sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(_cbor_dumps(obj)).digest()


def xxhash_pickle(obj: Any) -> bytes:
    return _xxh3_128(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def xxhash_cbor(obj: Any) -> bytes:
    return _xxh3_128(_cbor_dumps(obj))


_HASH_FNS: dict[str, HashFn] = {"sha256": sha256, "sha256_cbor": sha256_cbor, "xxhash": xxhash_pickle,
                                "xxhash_cbor": xxhash_cbor, "builtin": builtin}


def get_hash_fn_by_name(name: str) -> HashFn:
    fn = _HASH_FNS.get(name)
    if fn is None:
        raise ValueError(f"prefix_caching_hash_algo: unsupported {name!r} (allowed: {', '.join(HASH_ALGOS)})")
    if fn is not sha256 and fn is not builtin:
        fn((b"", (), None))  # a missing optional package fails here, naming the setting
    return fn


def none_hash_seed() -> str:
    return os.environ.get("PYTHONHASHSEED") or NONE_HASH_SEED


def make_none_hash(hash_fn: HashFn = sha256) -> bytes:
    """Deterministic across processes for sha256 unless PYTHONHASHSEED is set."""
    return hash_fn(none_hash_seed())


NONE_HASH: bytes = make_none_hash()


def hash_block_tokens(hash_fn: HashFn, parent_block_hash: Optional[bytes],
                      curr_block_token_ids: "list[int] | tuple[int, ...]",
                      extra_keys: Optional[tuple[Any, ...]] = None) -> bytes:
    if not parent_block_hash:
        parent_block_hash = NONE_HASH
    return hash_fn((parent_block_hash, tuple(curr_block_token_ids), extra_keys))


def make_block_hash_with_group_id(block_hash: bytes, group_id: int) -> bytes:
    return block_hash + group_id.to_bytes(4, "big", signed=False)


def get_block_hash(key: bytes) -> bytes:
    return key[:-4]


def get_group_id(key: bytes) -> int:
    return int.from_bytes(key[-4:], "big", signed=False)


def generate_block_hash_extra_keys(request: Any, start_token_idx: int) -> Optional[tuple[Any, ...]]:
    """LoRA keys in every block, cache salt only in the block that starts at token 0."""
    keys: list[Any] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        keys.append(("lora", getattr(lora, "lora_name", str(lora)), getattr(lora, "lora_path", None)))
    salt = getattr(request, "cache_salt", None)
    if salt is not None and start_token_idx == 0:
        keys.append(("cache_salt", salt))
    return tuple(keys) if keys else None


# (speed: requests that share a prefix - a shared system prompt, a prompt sent again, its greedy output -
# hash the same blocks again: SHA-256 of the pickle costs ~4.5 us a block, a hit in this cache ~1.5 us, the
# key's tuple hash and compare; a miss ~1 us more. A block's hash is a pure function of its
# (parent hash, tokens, extra keys), so a cached value is the one the function returns.)
BLOCK_HASH_CACHE_SIZE = 1 << 14  # entries per hash function, shared by the process's hashers (~20 MB)
_CACHED_HASH_FNS: dict[HashFn, HashFn] = {}


def cached_hash_fn(hash_fn: HashFn) -> HashFn:
    """`hash_fn` behind a bounded LRU cache when it is one of vLLM's hash functions (pure: `sha256`,
    `sha256_cbor`, `xxhash`, `xxhash_cbor`); `builtin` (cheaper than a lookup) and any other function
    as they are. Token ids are ints (what vLLM's engine hashes): the cache compares keys with `==`,
    so a token given as another type equal to an int (a bool, a numpy integer) would share that int's entry."""
    if hash_fn is builtin or hash_fn not in _HASH_FNS.values():
        return hash_fn
    cached = _CACHED_HASH_FNS.get(hash_fn)
    if cached is None:
        cached = _CACHED_HASH_FNS[hash_fn] = functools.lru_cache(maxsize=BLOCK_HASH_CACHE_SIZE)(hash_fn)
    return cached


def _token_reader(request: Any) -> tuple[int, Callable[[int, int], list[int]]]:
    """The request's token count and a reader of its tokens [start, end): a `Request`'s `get_token_ids`
    (speed: reads its prompt and output lists, `all_token_ids` is not built), else a slice of the
    `all_token_ids` of a request-like object (a router's probe)."""
    get_token_ids = getattr(request, "get_token_ids", None)
    if get_token_ids is not None:
        return request.num_tokens, get_token_ids
    tokens = request.all_token_ids
    return len(tokens), lambda start, end: tokens[start:end]


def get_request_block_hasher(block_size: int, hash_fn: HashFn = sha256,
                             num_lookahead_tokens: int = 0,
                             prompt_memo: Optional[PromptMemo] = None) -> Callable[[Any], list[bytes]]:
    """Closure returning the hashes of the request's full blocks not hashed yet (incremental).

    `prompt_memo` (the simulator's schedulers pass one): a request's first hashes, its prompt's full blocks,
    are kept per prompt list there and found again when the same list is sent again.

    `num_lookahead_tokens` (L > 0: EAGLE / MTP speculative decoding with prefix caching): each hash
    also covers the L tokens after its block, whose drafter KV at the block's last position depends
    on them, so a block is hashed only once they exist (vLLM 0.33 `kv_cache_utils.py:953-1030`)."""
    builtin_fn = hash_fn is builtin
    # (any other function is called for every block: it may be impure)
    memo = prompt_memo if hash_fn in _HASH_FNS.values() else None
    memo_tag = (block_size, hash_fn)  # (what a prompt's kept hashes depend on besides its tokens)
    hash_fn = cached_hash_fn(hash_fn)  # (speed: see cached_hash_fn)
    if num_lookahead_tokens:
        return _lookahead_request_block_hasher(block_size, hash_fn, num_lookahead_tokens)

    def request_block_hasher(request: Any) -> list[bytes]:
        hashes = request.block_hashes
        start = len(hashes) * block_size
        num_tokens, tokens_between = _token_reader(request)
        if start + block_size > num_tokens:
            return []
        has_lora = getattr(request, "lora_request", None) is not None
        prompt: Any = getattr(request, "prompt_token_ids", None)
        # (speed: a prompt sent again - the same list, servetwin.core.prompt_memo - takes its full blocks' hashes
        # from the memo: with no extra key they are a pure function of (block size, hash function, its tokens);
        # a `Request`'s tokens start with its prompt)
        memo_prompt = (memo is not None and not start and not has_lora and type(prompt) is list
                       and len(prompt) <= num_tokens and getattr(request, "cache_salt", None) is None)
        known = memo.get(prompt, memo_tag) if memo_prompt else None
        if known is not None:
            new_hashes = list(known)
            start = len(known) * block_size
            prev = known[-1] if known else NONE_HASH
        else:
            new_hashes = []
            prev = hashes[-1] if hashes else NONE_HASH
        # extra keys: LoRA in every block, the cache salt only in the block at token 0
        lora_keys = generate_block_hash_extra_keys(request, 1) if has_lora else None
        while start + block_size <= num_tokens:
            end = start + block_size
            extra = generate_block_hash_extra_keys(request, start) if start == 0 else lora_keys
            prev = hash_fn((prev, tuple(tokens_between(start, end)), extra))  # = hash_block_tokens(...)
            new_hashes.append(prev)
            start = end
        if memo_prompt and known is None:
            memo.put(prompt, tuple(new_hashes[:len(prompt) // block_size]), memo_tag)
        return new_hashes

    def builtin_request_block_hasher(request: Any) -> list[bytes]:
        """`request_block_hasher` with `builtin` inlined (the simulator's hot path: a decode's block)."""
        hashes = request.block_hashes
        start = len(hashes) * block_size
        num_tokens, tokens_between = _token_reader(request)
        if start + block_size > num_tokens:
            return []
        if not start or getattr(request, "lora_request", None) is not None:
            return request_block_hasher(request)  # the first blocks (a prompt's, cached) or extra keys
        parent = int.from_bytes(hashes[-1], "little")
        out = []
        while start + block_size <= num_tokens:
            end = start + block_size
            parent = hash((parent, tuple(tokens_between(start, end)))) & _MASK64  # = builtin((prev, tokens, None))
            out.append(parent.to_bytes(8, "little"))
            start = end
        return out

    hasher = builtin_request_block_hasher if builtin_fn else request_block_hasher
    hasher.block_size = block_size  # type: ignore[attr-defined]
    hasher.num_lookahead_tokens = 0  # type: ignore[attr-defined]
    hasher.prompt_memo = memo  # type: ignore[attr-defined]
    return hasher


def _lookahead_request_block_hasher(block_size: int, hash_fn: HashFn,
                                    num_lookahead_tokens: int) -> Callable[[Any], list[bytes]]:
    def request_block_hasher(request: Any) -> list[bytes]:
        hashes = request.block_hashes
        start = len(hashes) * block_size
        tokens = request.all_token_ids
        num_tokens = len(tokens) - num_lookahead_tokens
        prev = hashes[-1] if hashes else NONE_HASH
        new_hashes = []
        while start + block_size <= num_tokens:
            end = start + block_size
            extra = (generate_block_hash_extra_keys(request, start), *tokens[end:end + num_lookahead_tokens])
            prev = hash_fn((prev, tuple(tokens[start:end]), extra))
            new_hashes.append(prev)
            start = end
        return new_hashes

    request_block_hasher.block_size = block_size  # type: ignore[attr-defined]
    request_block_hasher.num_lookahead_tokens = num_lookahead_tokens  # type: ignore[attr-defined]
    return request_block_hasher
