"""`PromptMemo` and its users: a prompt sent again as the same list gets the values computed from its tokens
(its full blocks' hashes, `core/kv_cache/hashing.py`), equal to computing them again, whatever was sent
before - resent lists, lists grown in place, other block sizes and hash functions, a memo that is full."""
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from servetwin.core.kv_cache.hashing import NONE_HASH, builtin, get_request_block_hasher, sha256
from servetwin.core.prompt_memo import PromptMemo
from servetwin.core.request import Request
from servetwin.core.sampling_params import SamplingParams


def _reference(tokens, block_size, hash_fn, salt=None):
    """The chain computed block by block with the hash function itself (no memo, no cache)."""
    out, prev = [], NONE_HASH
    for start in range(0, len(tokens) - block_size + 1, block_size):
        extra = (("cache_salt", salt),) if salt is not None and start == 0 else None
        prev = hash_fn((prev, tuple(tokens[start:start + block_size]), extra))
        out.append(prev)
    return out


_sends = st.lists(st.tuples(st.integers(0, 3),  # which prompt list
                            st.lists(st.integers(0, 4), max_size=5),  # tokens appended to it in place first
                            st.lists(st.integers(0, 4), max_size=9),  # output tokens
                            st.sampled_from([None, None, "s"])),  # cache salt
                  min_size=1, max_size=10)


@settings(max_examples=150, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 4), max_size=12), min_size=1, max_size=4), sends=_sends,
       block_sizes=st.lists(st.integers(1, 4), min_size=1, max_size=2),
       algo=st.sampled_from(["sha256", "builtin"]), max_tokens=st.sampled_from([0, 10, 1 << 20]))
def test_resent_prompts_hash_as_computed_afresh(prompts, sends, block_sizes, algo, max_tokens):
    hash_fn = sha256 if algo == "sha256" else builtin
    memo = PromptMemo(max_tokens=max_tokens)  # 0 / 10: full at once / soon
    # (one memo shared by hashers of several block sizes, and a hasher without one)
    hashers = [(bs, get_request_block_hasher(bs, hash_fn, prompt_memo=memo)) for bs in block_sizes]
    hashers.append((block_sizes[0], get_request_block_hasher(block_sizes[0], hash_fn)))
    for i, (p, grow, output, salt) in enumerate(sends):
        prompt = prompts[p % len(prompts)]
        prompt.extend(grow)  # (in place: the memo must not give the shorter list's hashes)
        for bs, hasher in hashers:
            req = Request(f"r{i}", prompt, SamplingParams(max_tokens=100), arrival_time=0.0, cache_salt=salt,
                          block_hasher=hasher, hash_block_size=bs)
            assert req.prompt_token_ids is prompt  # (kept, as vLLM keeps it)
            for token in output:
                req.append_output_token_ids(token)
            assert req.block_hashes == _reference(prompt + output, bs, hash_fn, salt)
            assert req.all_token_ids == prompt + output and prompt is not req.all_token_ids


def test_request_like_objects_without_a_prompt_list_hash_their_tokens():
    hasher = get_request_block_hasher(2, sha256)
    for prompt in (None, (1, 2, 3, 4)):  # no list to key on: every block hashed
        req = SimpleNamespace(block_hashes=[], all_token_ids=[1, 2, 3, 4, 5], prompt_token_ids=prompt)
        assert hasher(req) == _reference([1, 2, 3, 4, 5], 2, sha256)


def test_memo_keys_on_the_list_and_its_length_and_stops_storing_when_full():
    memo = PromptMemo(max_tokens=5)
    a, b = [1, 2, 3], [1, 2, 3]
    memo.put(a, "A")
    assert memo.get(a) == "A" and memo.get(b) is None  # an equal list is another prompt
    assert memo.get(a, tag=2) is None
    memo.put(b, "B")  # 6 tokens would not fit
    assert memo.get(b) is None and len(memo) == 1 and memo.num_tokens == 3
    a.append(4)
    assert memo.get(a) is None  # grown in place: stale
    memo.put(a, "A4")
    assert memo.get(a) == "A4" and memo.num_tokens == 4
    memo.clear()
    assert memo.get(a) is None and memo.num_tokens == 0 and len(memo) == 0


def test_only_the_simulators_schedulers_keep_prompts():
    """A real engine's scheduler hashes without a memo (a server would otherwise hold its prompts); the
    simulator's keeps one per engine."""
    from servetwin.core.sched.config import CacheConfig, SchedulerConfig  # noqa: PLC0415
    from servetwin.core.sched.scheduler import Scheduler  # noqa: PLC0415
    from servetwin.sim.scheduler import SimScheduler  # noqa: PLC0415

    def make(cls):
        return cls(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                   CacheConfig(block_size=4, num_gpu_blocks=32, enable_prefix_caching=True))

    prompt = list(range(12))
    for cls, kept in ((Scheduler, False), (SimScheduler, True)):
        sched = make(cls)
        req = Request("r", prompt, SamplingParams(max_tokens=4), arrival_time=0.0)
        sched.add_request(req)
        again = Request("s", prompt, SamplingParams(max_tokens=4), arrival_time=0.0)
        sched.add_request(again)
        assert again.block_hashes == req.block_hashes == _reference(prompt, 4, sha256)
        memo = sched.block_hasher.prompt_memo
        # the simulator's: the prompt's hashes kept once (both requests sent the same list)
        assert (memo is not None and len(memo) == 1 and memo.num_tokens == len(prompt)) if kept else memo is None
