"""Sim vs torch with KV connectors: the same workload on tiny-llama (CPU) and on the simulator, the
simulator replaying the torch run's transfer completions (`TransferRecorder` / `TransferReplay`,
sim/kv_transfer_replay.py), schedules every step identically: scheduled tokens, the requests waiting
for remote KV, the reads / offload jobs started and those reported done, step by step.

- CPU offload (`OffloadingConnector`): a prefix set larger than the KV pool but within the CPU tier,
  requests arriving while others run (stores, loads from the tier, preemptions in a tight pool).
- P/D, consumer side (`NixlConnector`, `kv_consumer`): a prefill engine (torch, this process, its
  side channel on a free port) prefills every prompt; the decode engine - torch reading the KV over
  the side channel, or the simulator - admits them with their `kv_transfer_params` in a pool that
  cannot hold every read at once, some prompts sharing a prefix its local cache already holds.
(A test of both backends, so it lives with the torch tests; sim never imports torch.)
"""
from __future__ import annotations

import random
import socket

from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_core import EngineCore
from servetwin.core.engine.engine_factory import create_executor
from servetwin.core.request import Request, RequestStatus
from servetwin.core.sampling_params import SamplingParams
from servetwin.sim.kv_transfer import build_kv_worker
from servetwin.sim.kv_transfer_replay import TransferRecorder, TransferReplay

ENGINE = dict(model="tiny-llama", device="cpu", dtype="float32", max_model_len=64, max_num_batched_tokens=48,
              max_num_seqs=4, block_size=4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Recorder:
    """The executor, each step's transfers observed (what `TransferReplay` replays)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.transfers = TransferRecorder()

    def __getattr__(self, name):  # kv_transfer_config, scheduler_cls, ... as the inner executor's
        return getattr(self.inner, name)

    def execute_model(self, so):
        out = self.inner.execute_model(so)
        self.transfers.observe(so.kv_connector_metadata, out.kv_connector_output)
        return out


def _step_record(engine: EngineCore, result) -> tuple:
    """(scheduled tokens, requests in WAITING_FOR_REMOTE_KVS after the step, reads started with their
    blocks, offload load / store jobs and flushes, (finished_recving, completed jobs))."""
    so, mro = result.scheduled, result.model_output
    meta = so.kv_connector_metadata if so is not None else None
    kv_out = mro.kv_connector_output if mro is not None else None
    waiting = sorted(rid for rid, r in engine.scheduler.requests.items()
                     if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS)
    started = {rid: len(recv.local_block_ids[0]) for rid, recv in getattr(meta, "reqs_to_recv", {}).items()
               if recv.awaiting_kvs}  # each read's blocks
    jobs = ({j: (job.req_id, tuple(job.gpu_block_ids)) for j, job in meta.load_jobs.items()},
            {j: (job.req_id, tuple(job.gpu_block_ids)) for j, job in meta.store_jobs.items()},
            sorted(meta.jobs_to_flush)) if hasattr(meta, "load_jobs") else None
    done = (sorted(kv_out.finished_recving or ()), sorted(kv_out.completed_jobs or {})) if kv_out else None
    return (dict(so.num_scheduled_tokens) if so is not None else None, waiting, started, jobs, done)


def run(backend: str, kv_config: dict, arrivals: list[tuple[int, Request]],
        replay: TransferReplay | None = None, **engine) -> tuple[list[tuple], TransferReplay, dict]:
    """Every step's record (`_step_record`), the run's transfer completions and its outputs; request
    `arrivals[i]` is added before step `arrivals[i][0]`."""
    args = EngineArgs.from_kwargs(backend=backend, kv_transfer_config=kv_config, **{**ENGINE, **engine})
    info = create_executor(args)
    if replay is not None:
        info.executor.enable_kv_transfer(build_kv_worker(args.kv_transfer_config, info.executor.kv_worker.kv_bytes_per_token,
                                                         args.block_size, replay=replay))
    ex = Recorder(info.executor)
    engine_core = EngineCore(args.scheduler_config(info.max_model_len), args.cache_config(info.num_gpu_blocks), ex,
                             kv_transfer_config=args.kv_transfer_config)
    steps, outputs, pending = [], {}, list(arrivals)
    try:
        while pending or engine_core.has_work():
            while pending and pending[0][0] <= len(steps):
                engine_core.add_request(pending.pop(0)[1])
            result = engine_core.step()
            steps.append(_step_record(engine_core, result))
            for o in result.outputs:
                outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    finally:
        if hasattr(info.executor, "close"):
            info.executor.close()
    return steps, ex.transfers.replay, outputs


def _compare(kv_config: dict, make_arrivals, **engine) -> tuple[list[tuple], TransferReplay]:
    torch_steps, replay, _ = run("torch", kv_config, make_arrivals(), **engine)
    sim_steps, _, _ = run("sim", kv_config, make_arrivals(), replay=replay, **engine)
    assert len(sim_steps) == len(torch_steps)
    for i, (t, s) in enumerate(zip(torch_steps, sim_steps)):
        assert s == t, f"step {i}"
    return torch_steps, replay


# --- CPU offload --------------------------------------------------------------------------------

OFFLOAD_POOL = 24  # blocks of 4 tokens: the six 16-token prefixes need 24 blocks by themselves
PREFIXES = [[7 + 11 * p + i for i in range(16)] for p in range(6)]


def _offload_arrivals() -> list[tuple[int, Request]]:
    """Two rounds over six prefixes (each prompt its own 5-token suffix), a request every 4 steps:
    a prefix comes back after the others pushed it out of the pool."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    return [(2 * i, Request(f"r{i}", PREFIXES[p] + [200 + 10 * r + p + j for j in range(5)], params))
            for i, (r, p) in enumerate((r, p) for r in range(2) for p in range(6))]


def test_offload_sim_replays_the_torch_runs_steps():
    chunk = _torch_kv_bytes_per_block()  # one CPU chunk per block: the same tier size on both backends
    config = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"cpu_bytes_to_use": 64 * 4096, "kv_bytes_per_block": chunk}}
    steps, replay = _compare(config, _offload_arrivals, num_gpu_blocks=OFFLOAD_POOL)
    loads = [j for s in steps if s[3] for j in s[3][0]]
    assert len(loads) >= 4  # second-round prefixes came back from the CPU tier
    assert any(rid for s in steps for rid in s[1])  # ... through WAITING_FOR_REMOTE_KVS
    assert replay.jobs and all(d == 0 for d in replay.jobs.values())  # the torch worker copies in the step


def _torch_kv_bytes_per_block() -> int:
    args = EngineArgs.from_kwargs(backend="torch", num_gpu_blocks=OFFLOAD_POOL, **ENGINE)
    info = create_executor(args)
    return info.executor.kv_bytes_per_block


# --- P/D, consumer side -------------------------------------------------------------------------

PD_POOL = 20  # the decode engine's blocks of 4 tokens: reads wait for room (head-of-line blocking)
SHARED = [5 + i for i in range(8)]  # a prefix (two blocks) that the decode engine's local cache gets


def _pd_prompts() -> dict[str, list[int]]:
    rng = random.Random(3)
    return {f"q{i}": (SHARED if i % 3 == 0 else []) + [rng.randrange(20, 300) for _ in range(6 + (i * 7) % 19)]
            for i in range(10)}


def _prefill(prompts: dict[str, list[int]], port: int):
    """A prefill engine (torch, this process) that prefilled every prompt: (its executor, which serves
    the reads until closed, and each prompt's kv_transfer_params for the decode engine)."""
    args = EngineArgs.from_kwargs(backend="torch", num_gpu_blocks=128, **ENGINE,
                                  kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": "kv_producer",
                                                      "kv_connector_extra_config": {"side_channel_port": port}})
    info = create_executor(args)
    engine = EngineCore(args.scheduler_config(info.max_model_len), args.cache_config(info.num_gpu_blocks),
                        info.executor, kv_transfer_config=args.kv_transfer_config)
    for rid, prompt in prompts.items():
        engine.add_request(Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1, extra_args={
            "kv_transfer_params": {"do_remote_decode": True}})))
    handoff = {}
    while len(handoff) < len(prompts):
        for o in engine.step().outputs:
            if o.finish_reason is not None:
                handoff[o.request_id] = o.kv_transfer_params
    return info.executor, handoff


def test_pd_consumer_sim_replays_the_torch_runs_steps():
    prompts = _pd_prompts()
    producer, handoff = _prefill(prompts, _free_port())
    try:
        def arrivals() -> list[tuple[int, Request]]:
            return [(i // 2 * 3, Request(rid, p, SamplingParams(temperature=0.0, max_tokens=5 + i % 4, ignore_eos=True,
                                                                 extra_args={"kv_transfer_params": dict(handoff[rid])})))
                    for i, (rid, p) in enumerate(prompts.items())]
        steps, replay = _compare({"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}, arrivals,
                                 num_gpu_blocks=PD_POOL, enable_prefix_caching=True)
        arrived = {r.request_id: step for step, r in arrivals()}
    finally:
        producer.close()
    assert sorted(replay.recv) == sorted(prompts) and all(d == [0] for d in replay.recv.values())
    assert {rid for s in steps for rid in s[1]} == set(prompts)  # every request waited for its KV
    read_at = {rid: i for i, s in enumerate(steps) for rid in s[2]}
    read_blocks = {rid: n for s in steps for rid, n in s[2].items()}
    assert any(read_at[rid] > arrived[rid] for rid in prompts)  # no room for a read: it waited its turn
    assert any(read_blocks[rid] < -(-len(p) // 4) for rid, p in prompts.items())  # a local hit, the rest read
    first = {rid: next(n for s in steps if s[0] and (n := s[0].get(rid))) for rid in prompts}
    assert all(n == 1 for n in first.values())  # after the read only the last token is recomputed
