"""KV cache: the manager, the block pool with its prefix-cache map, block hashing, pool sizing, hit-rate metrics."""
