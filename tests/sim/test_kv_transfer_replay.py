"""Replaying a recorded run's KV-transfer completions (sim/kv_transfer_replay.py): the simulator's
worker reports each transfer the recorded number of steps after it started, whatever the link."""
from __future__ import annotations

import pytest

from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_factory import create_engine_core
from servetwin.core.request import Request
from servetwin.core.sampling_params import SamplingParams
from servetwin.sim.kv_transfer import build_kv_worker
from servetwin.sim.kv_transfer_replay import TransferRecorder, TransferReplay

BLOCK = 16
SLOW_LINK = {"bandwidth_gbps": 0.5, "latency_us": 10.0}  # transfers take several decode steps
CONSUMER = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
OFFLOAD = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}}


def _engine(kv: dict, link_key: str = "kv_link", link=None, replay: TransferReplay | None = None, **kw):
    extra = {**kv.get("kv_connector_extra_config", {}), **({link_key: link} if link is not None else {})}
    args = EngineArgs.from_kwargs(**{**dict(backend="sim", model="qwen3-8b", hardware="h100-sxm", num_gpu_blocks=64,
                                            max_model_len=512, block_size=BLOCK), **kw},
                                  kv_transfer_config={**kv, "kv_connector_extra_config": extra})
    core, _ = create_engine_core(args)
    if replay is not None:
        worker = core.executor.kv_worker
        core.executor.enable_kv_transfer(build_kv_worker(args.kv_transfer_config, worker.kv_bytes_per_token,
                                                         BLOCK, replay=replay))
    return core


def _remote(rid: str, num_blocks: int) -> dict:
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [list(range(num_blocks))],
            "remote_engine_id": "prefill-0", "remote_request_id": rid, "remote_host": "localhost", "remote_port": 1}


def _remote_reads() -> list[Request]:
    """Six decode-side requests of 3-13 blocks, each reading its whole prompt."""
    out = []
    for i in range(6):
        n = (3 + 5 * i % 11) * BLOCK
        out.append(Request(f"r{i}", list(range(10 + i, 10 + i + n)), SamplingParams(
            max_tokens=4 + i, ignore_eos=True, extra_args={"kv_transfer_params": _remote(f"p{i}", n // BLOCK)})))
    return out


def _prefix_rounds() -> list[Request]:
    """Two rounds over four 8-block prefixes (a small pool holds two): the second round loads them."""
    return [Request(f"r{r}{p}", [1000 * p + i for i in range(8 * BLOCK)] + [50 + r] * 4,
                    SamplingParams(max_tokens=3, ignore_eos=True)) for r in range(2) for p in range(4)]


def _run(core, requests: list[Request]) -> tuple[list[tuple], TransferReplay]:
    """(every step's scheduled tokens, finished reads and completed jobs; the run's completions as
    recorded)."""
    recorder = TransferRecorder()
    for r in requests:
        core.add_request(r)
    steps = []
    while core.has_work():
        res = core.step()
        kv_out = res.model_output.kv_connector_output if res.model_output is not None else None
        if res.scheduled is not None:
            recorder.observe(res.scheduled.kv_connector_metadata, kv_out)
        steps.append((dict(res.scheduled.num_scheduled_tokens) if res.scheduled is not None else None,
                      sorted(kv_out.finished_recving or ()) if kv_out is not None else [],
                      sorted(kv_out.completed_jobs or {}) if kv_out is not None else []))
    return steps, recorder.replay


def test_a_replayed_run_reports_every_read_in_the_recorded_step():
    slow_steps, slow = _run(_engine(CONSUMER, link=SLOW_LINK), _remote_reads())
    assert any(d and d[0] > 0 for d in slow.recv.values())  # the slow link: reads finish steps later
    fast_steps, fast = _run(_engine(CONSUMER), _remote_reads())
    assert fast_steps != slow_steps  # the default link reports them sooner ...
    replayed_steps, again = _run(_engine(CONSUMER, replay=slow), _remote_reads())
    assert replayed_steps == slow_steps  # ... unless it replays the slow run's completions
    assert again == slow


def test_a_replayed_run_completes_every_offload_job_in_the_recorded_step():
    engine = dict(num_gpu_blocks=20, max_num_seqs=2, max_model_len=256)
    slow_steps, slow = _run(_engine(OFFLOAD, "pcie_link", SLOW_LINK, **engine), _prefix_rounds())
    assert any(d is not None and d > 0 for d in slow.jobs.values())  # stores and loads finish steps later
    assert any(s[1] for s in slow_steps)  # loads from the CPU tier (reported in finished_recving)
    fast_steps, _ = _run(_engine(OFFLOAD, **engine), _prefix_rounds())
    assert fast_steps != slow_steps
    replayed_steps, again = _run(_engine(OFFLOAD, replay=slow, **engine), _prefix_rounds())
    assert replayed_steps == slow_steps and again == slow


def test_a_transfer_the_recording_lacks_is_an_error():
    core = _engine(CONSUMER, replay=TransferReplay())
    core.add_request(Request("r", list(range(10, 10 + 2 * BLOCK)), SamplingParams(
        max_tokens=2, extra_args={"kv_transfer_params": _remote("p", 2)})))
    with pytest.raises(ValueError, match="recv #0 of r was not recorded"):
        core.step()
