"""Prefix-cache block hashing (vLLM 0.33 `kv_cache_utils.py`): chained sha256 over pickled tuples."""
from __future__ import annotations

import hashlib
import os
import pickle
from typing import Any, Callable, Optional

BlockHash = bytes
HashFn = Callable[[Any], bytes]
NONE_HASH_SEED = "vllm-none-hash"


def sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def get_hash_fn_by_name(name: str) -> HashFn:
    if name == "sha256":
        return sha256
    raise ValueError(f"prefix_caching_hash_algo: unsupported {name!r} (allowed: 'sha256')")


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


def get_request_block_hasher(block_size: int, hash_fn: HashFn = sha256) -> Callable[[Any], list[bytes]]:
    """Closure returning the hashes of the request's full blocks not hashed yet (incremental)."""

    def request_block_hasher(request: Any) -> list[bytes]:
        hashes = request.block_hashes
        start = len(hashes) * block_size
        tokens = request.all_token_ids
        num_tokens = len(tokens)
        if start + block_size > num_tokens:
            return []
        prev = hashes[-1] if hashes else NONE_HASH
        new_hashes = []
        # extra keys: LoRA in every block, the cache salt only in the block at token 0
        lora_keys = (generate_block_hash_extra_keys(request, 1)
                     if getattr(request, "lora_request", None) is not None else None)
        while start + block_size <= num_tokens:
            end = start + block_size
            extra = generate_block_hash_extra_keys(request, start) if start == 0 else lora_keys
            prev = hash_fn((prev, tuple(tokens[start:end]), extra))  # = hash_block_tokens(...)
            new_hashes.append(prev)
            start = end
        return new_hashes

    request_block_hasher.block_size = block_size  # type: ignore[attr-defined]
    return request_block_hasher
