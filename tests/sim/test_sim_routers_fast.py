"""The routers' fast paths equal the plain loops they replace (same keys, same LRU order, same matches)."""
from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from servetwin.sim.routers import ApproxPrefixIndex, prompt_block_keys


def _keys_loop(tokens, block_tokens, max_blocks):
    """prompt_block_keys as a slice and a tuple per block."""
    keys, parent = [], 0
    for start in range(0, min(len(tokens) // block_tokens, max_blocks) * block_tokens, block_tokens):
        parent = hash((parent, tuple(tokens[start:start + block_tokens])))
        keys.append(parent)
    return keys


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 50), max_size=80), block_tokens=st.integers(1, 9),
       max_blocks=st.integers(-2, 30), as_tuple=st.booleans())
def test_prompt_block_keys_equal_the_per_block_loop(tokens, block_tokens, max_blocks, as_tuple):
    prompt = tuple(tokens) if as_tuple else tokens
    assert prompt_block_keys(prompt, block_tokens, max_blocks) == _keys_loop(prompt, block_tokens, max_blocks)


class _LoopIndex:
    """ApproxPrefixIndex with an assignment and a move per key, and llm-d's matchLongestPrefix walk over the
    LRUs themselves (no key -> endpoints map)."""

    def __init__(self, capacity):
        self.capacity, self.lru = capacity, {}

    def matched(self, endpoint, keys):
        n = 0
        for k in keys:
            held = [e for e, table in self.lru.items() if k in table]
            if not held:
                break
            n += endpoint in held
        return n

    def add(self, endpoint, keys):
        table = self.lru.setdefault(endpoint, OrderedDict())
        for k in keys:
            table[k] = None
            table.move_to_end(k)
        while len(table) > self.capacity:
            table.popitem(last=False)


# keys drawn from a small range: repeats within a prompt and across prompts, and LRU evictions
_keys = st.lists(st.integers(0, 12), max_size=10)


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(1, 12),
       ops=st.lists(st.tuples(st.booleans(), st.integers(0, 2), _keys), max_size=25))
def test_approx_prefix_index_equals_the_plain_loops(capacity, ops):
    fast, ref = ApproxPrefixIndex(capacity), _LoopIndex(capacity)
    for add, endpoint, keys in ops:
        if add:
            fast.add(endpoint, keys)
            ref.add(endpoint, keys)
        else:
            assert fast.matches(keys).get(endpoint, 0) == ref.matched(endpoint, keys)
        assert {e: list(t) for e, t in fast.lru.items()} == {e: list(t) for e, t in ref.lru.items()}
        assert fast.holders == {k: {e for e, t in ref.lru.items() if k in t} for t in ref.lru.values() for k in t}


@settings(max_examples=100, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 3), max_size=40), min_size=1, max_size=6),
       sends=st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=1, max_size=30),
       tail=st.booleans())
def test_prefix_scorer_keys_kept_per_prompt_list_equal_fresh_keys(prompts, sends, tail):
    """A prompt list sent again reuses its keys; a list equal in content but another object, or the same
    object grown, gets its own: always the keys prompt_block_keys gives."""
    from types import SimpleNamespace  # noqa: PLC0415

    from servetwin.sim.routers import PrefixCacheScorer  # noqa: PLC0415
    scorer = PrefixCacheScorer(block_tokens=4, tail_block=tail)
    lists = [list(p) for p in prompts]
    for which, copy in sends:
        tokens = lists[which % len(lists)]
        if copy:
            tokens = list(tokens)
        expected = prompt_block_keys(tokens, 4, scorer.max_blocks, tail)
        assert scorer.keys(SimpleNamespace(prompt_token_ids=tokens)) == expected
    grown = lists[0]
    grown.append(1)
    assert scorer.keys(SimpleNamespace(prompt_token_ids=grown)) == prompt_block_keys(grown, 4, scorer.max_blocks, tail)
