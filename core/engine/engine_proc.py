"""The EngineCore process: builds the executor, sizes the KV cache, then runs the busy loop.

Started by `servetwin.core.engine.mp_client` as a fresh interpreter, `python -m servetwin.core.engine.engine_proc`
(it imports only servetwin, never the caller's `__main__`); its only arguments - the picklable
`EngineArgs`, the two ZMQ addresses and a few loop options - arrive pickled on its standard input. Start-up: build the engine
(`create_engine_core`), then send one `EngineConfig` (the ready message with the final
`num_gpu_blocks`, `max_model_len`, vocab size, EOS ids, model path) or a `StartupErrorMsg` with the
exception text, and exit.

Busy loop (like vLLM's `EngineCoreProc.run_busy_loop`): take every input waiting on the input socket
(add / abort / utility / shutdown), run one `EngineCore.step()` while there is work, send the step's
`EngineCoreOutput`s with the scheduler stats, and when the engine runs out of work send an idle
marker carrying the number of the last input message processed (the synchronous client uses it to
know that no more output can come). With nothing to do it blocks on the input socket, waking every
0.5 s to check that its parent is still alive (it exits when the parent is gone, so an engine never
outlives its front end).

MoE data parallelism: when the executor reports an MoE model and the engine is one rank of several
(`dp`, a `DPRankInfo`), it joins the backend's DP group and runs `run_lockstep` instead (vLLM's
`DPEngineCoreProc`; core/engine/dp_lockstep.py has the rules): a step - or a dummy batch - on every rank
while the wave runs, each followed by the step barrier. Not combined with paced mode.

Paced (simulated-time) mode, used to serve a `sim` backend in "real time": every step's duration is
the executor's prediction `ModelRunnerOutput.timing.duration_s`. Simulated time is mapped onto wall
time from the moment the engine became ready, `wall = t_ready + sim * time_scale`. While the engine has
work its steps follow each other back to back in simulated time (step k+1 starts at step k's end, so
host overhead between steps is not added to the cost model's prediction); the first step after an idle
period starts at `max(end of the previous step, simulated now)`. A step's outputs are released once the
wall clock reaches the mapped end of the step - never earlier; if the host falls behind (computing a
step took longer than its mapped duration) they are released as soon as they are ready and the step
counts as late (`get_stats` -> `paced_late_steps`, `paced_max_late_s`). With async scheduling the
outputs of step k are processed one step later but are still released at step k's end time.

Simulated time (`servetwin.core.engine.sim_clock.SimClock`) is kept for the `sim` backend whether
paced or not: every outputs message carries the simulated end of the step that computed its tokens
(`sim_time_s`) and the simulated arrival of the requests added since the previous message
(`sim_arrivals`), so the front end reports predicted times (`RequestMetrics.predicted_ttft_s`, ...);
`get_stats` gives `sim_time_s` / `sim_busy_s`.
"""
from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from collections import deque
from typing import Any, Optional

PARENT_CHECK_INTERVAL_S = 0.5
IDLE_STATS_INTERVAL_S = 0.1
IPC_PROFILE_LEN = 20000



def error_kind(e: BaseException) -> str:
    """The exception's name as the client re-raises it: subclasses of the kinds it knows
    (`ConfigError`, `ModelNotFoundError`) travel as their base."""
    return next((k.__name__ for k in (FileNotFoundError, ValueError) if isinstance(e, k)), type(e).__name__)

class EngineCoreProc:
    def __init__(self, engine_core: Any, info: Any, args: Any, input_addr: str, output_addr: str,
                 parent_pid: int, pace: bool = False, time_scale: float = 1.0) -> None:
        import zmq  # noqa: PLC0415

        from servetwin.core.engine import messages as m  # noqa: PLC0415

        self.m = m
        self.zmq = zmq
        self.engine = engine_core
        self.info = info
        self.args = args
        self.parent_pid = parent_pid
        self.last_parent_check = time.monotonic()  # parent_gone's clock
        self.pace = pace
        self.time_scale = float(time_scale)
        self.ctx = zmq.Context(io_threads=1)
        self.input = self.ctx.socket(zmq.PULL)
        self.input.setsockopt(zmq.LINGER, 0)
        self.input.connect(input_addr)
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.setsockopt(zmq.LINGER, 2000)
        self.output.connect(output_addr)
        self.encoder = m.encoder()
        self.decoder = m.input_decoder()
        self._EVENTS, self._POLLIN = zmq.EVENTS, zmq.POLLIN
        self.input_seq = -1  # number of the last input message processed
        self.running = True
        # totals for /metrics
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.num_steps = 0
        # pacing and simulated time (the sim backend's predictions; a paced fake backend's step times)
        from servetwin.core.engine.sim_clock import SimClock  # noqa: PLC0415

        self.t_ready = time.monotonic()
        self.clock = SimClock() if (pace or args.backend == "sim") else None
        self.late_steps = 0
        self.max_late_s = 0.0
        # IPC profile per step that sent outputs: (num outputs, seconds encoding + sending them, seconds
        # checking / reading the input socket before the step); plus the total input-handling time
        self.ipc_profile: deque[tuple[int, float, float]] = deque(maxlen=IPC_PROFILE_LEN)
        self.input_time_s = 0.0
        self.input_msgs = 0
        # MoE data parallelism: the rank's wave state (`start_lockstep`); None runs the plain loop
        self.lockstep: Any = None
        self.idle_sent_seq = -1  # lockstep loop: the last input number an idle marker was sent for

    # -- messages ---------------------------------------------------------------------------------
    def send(self, msg: Any) -> None:
        self.output.send(self.encoder.encode(msg))

    def send_ready(self) -> None:
        info = self.info
        self.t_ready = time.monotonic()
        self.send(self.m.EngineConfig(
            num_gpu_blocks=int(info.num_gpu_blocks), max_model_len=int(info.max_model_len),
            vocab_size=None if info.vocab_size is None else int(info.vocab_size),
            eos_token_ids=[int(t) for t in (info.eos_token_ids or [])],
            model_path=None if info.model_path is None else str(info.model_path),
            block_size=int(self.args.block_size), backend=str(self.args.backend), pid=os.getpid(),
            paced=self.pace, time_scale=self.time_scale))

    def handle_inputs(self, block_ms: int) -> list[Any]:
        """Process every waiting input message (waiting up to `block_ms` for the first one)."""
        errors: list[Any] = []
        sock = self.input
        if block_ms:
            if not sock.poll(block_ms):
                return errors
        elif not sock.get(self._EVENTS) & self._POLLIN:  # cheap check, no exception, on every busy step
            return errors
        t0 = time.perf_counter()
        zmq_again = self.zmq.Again
        noblock = self.zmq.NOBLOCK
        while True:
            try:
                frame = sock.recv(noblock, copy=False)
            except zmq_again:
                break
            msg = self.decoder.decode(frame.buffer)
            self.input_seq += 1
            self.input_msgs += 1
            self.handle_input(msg, errors)
        self.input_time_s += time.perf_counter() - t0
        return errors

    def handle_input(self, msg: Any, errors: list[Any]) -> None:
        m = self.m
        if type(msg) is m.AddRequestMsg:
            from servetwin.core.request import Request  # noqa: PLC0415

            try:
                self.engine.add_request(Request(msg.request_id, msg.prompt_token_ids, m.decode_params(msg.params),
                                                arrival_time=msg.arrival_time, priority=msg.priority,
                                                cache_salt=msg.cache_salt, parent_id=msg.parent_id))
                if self.clock is not None:
                    self.clock.on_add(msg.request_id, self._sim_now() if self.pace else None)
                if self.lockstep is not None:
                    wave = self.lockstep.on_local_request()
                    if wave is not None:  # this rank was idle: the front end wakes the others
                        self.send(m.OutputsMsg([], self.stats(), start_wave=wave))
            except ValueError as e:  # unservable / duplicate request: report it, keep serving
                errors.append(m.RequestErrorMsg(msg.request_id, error_kind(e), str(e)))
        elif type(msg) is m.AbortMsg:
            self.engine.abort_requests(msg.request_ids)
        elif type(msg) is m.UtilityMsg:
            self.handle_utility(msg)
        elif type(msg) is m.BatchMsg:
            for sub in msg.msgs:
                self.handle_input(sub, errors)
        elif type(msg) is m.ShutdownMsg:
            self.running = False
        elif type(msg) is m.StartDPWaveMsg:
            if self.lockstep is not None:
                self.lockstep.on_start_wave(msg.wave)

    def handle_utility(self, msg: Any) -> None:
        from servetwin.core.engine.engine_client import call_utility  # noqa: PLC0415

        m = self.m
        try:
            if msg.name == "get_ipc_profile":
                result: Any = {"steps": list(self.ipc_profile), "input_time_s": self.input_time_s,
                               "input_msgs": self.input_msgs}
            elif msg.name == "clear_ipc_profile":
                self.ipc_profile.clear()
                self.input_time_s, self.input_msgs = 0.0, 0
                result = True
            else:
                result = call_utility(self.engine, msg.name, *msg.args)
                if msg.name == "get_stats":
                    result = dict(result, num_steps=self.num_steps, prefix_cache_queries=self.prefix_queries,
                                  prefix_cache_hits=self.prefix_hits, paced=self.pace,
                                  paced_late_steps=self.late_steps, paced_max_late_s=self.max_late_s,
                                  sim_time_s=self.clock.now if self.clock else 0.0,
                                  sim_busy_s=self.clock.busy_s if self.clock else 0.0,
                                  **(self.lockstep.stats() if self.lockstep is not None else {}))
            self.send(m.UtilityResultMsg(msg.call_id, result))
        except Exception as e:  # noqa: BLE001 - the caller gets the error text
            self.send(m.UtilityResultMsg(msg.call_id, None, f"{type(e).__name__}: {e}", error_kind(e)))

    def stats(self) -> Any:
        from servetwin.core.engine.engine_client import kv_connector_totals, spec_decode_totals  # noqa: PLC0415

        sched = self.engine.scheduler
        kv = sched.kv_cache_manager
        return self.m.EngineStats(len(sched.running), len(sched.waiting), kv.usage, kv.num_free_blocks,
                                  self.prefix_queries, self.prefix_hits, sched.num_preemptions_total,
                                  self.num_steps, self.clock.busy_s if self.clock else 0.0,
                                  **spec_decode_totals(self.engine), **kv_connector_totals(self.engine))

    def outputs_msg(self, outputs: list, idle_seq: int = -1, errors: Optional[list] = None,
                    release_at: float = 0.0, sim_t: float = 0.0) -> Any:
        """An outputs message with the stats and, in simulated time, the arrivals stamped since the last."""
        arrivals = self.clock.take_arrivals() if self.clock is not None else None
        return self.m.OutputsMsg(outputs, self.stats(), idle_seq, errors or None, release_at, sim_t,
                                 arrivals or None)

    # -- pacing -------------------------------------------------------------------------------------
    def _sim_now(self) -> float:
        return (time.monotonic() - self.t_ready) / self.time_scale

    def _pace(self, result: Any, sim_now: Optional[float]) -> tuple[float, float]:
        """Advance simulated time by the scheduled step's predicted duration and wait until the processed
        step's end. `sim_now` (simulated time when the step was scheduled) is given only after the engine
        was idle: a busy engine's steps follow each other back to back in simulated time, so host-side
        overhead between steps is not added on top of the cost model's prediction."""
        end = self.clock.on_step(result, sim_now)
        if end is None:
            return 0.0, self.clock.now
        release_at = self.t_ready + end * self.time_scale
        now = time.monotonic()
        late = now - release_at
        if late > 1e-3:
            self.late_steps += 1
            self.max_late_s = max(self.max_late_s, late)
        while now < release_at:
            time.sleep(release_at - now)
            now = time.monotonic()
        return release_at, end

    # -- loop ---------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        """Requests to run or batches in flight. Finished ids alone don't count: they ride along with the
        next real step (the in-process `LLM` stops stepping at the same point, so both modes run
        exactly the same sequence of steps)."""
        return self.engine.scheduler.has_unfinished_requests() or bool(self.engine.batch_queue)

    def parent_alive(self) -> bool:
        return os.getppid() == self.parent_pid

    def parent_gone(self, now: float) -> bool:
        """At most every PARENT_CHECK_INTERVAL_S (the check is a syscall; the loops call this each pass):
        whether the parent process died (the engine must not outlive it)."""
        if now - self.last_parent_check <= PARENT_CHECK_INTERVAL_S:
            return False
        self.last_parent_check = now
        return not self.parent_alive()

    def run(self) -> None:
        if self.lockstep is not None:
            self.run_lockstep()
            return
        m = self.m
        engine = self.engine
        busy = False
        self.last_parent_check = time.monotonic()
        last_stats = 0.0
        perf = time.perf_counter
        while self.running:
            if self.has_work():
                t_in0 = perf()
                errors = self.handle_inputs(0)
                t_in = perf() - t_in0
            else:
                t_in = 0.0
                if busy:
                    busy = False
                    self.send(self.outputs_msg([], idle_seq=self.input_seq))
                errors = self.handle_inputs(int(PARENT_CHECK_INTERVAL_S * 1000))
                if errors and not self.has_work():  # only refused requests arrived
                    self.send(self.outputs_msg([], idle_seq=self.input_seq, errors=errors))
                    errors = []
            if not self.running:
                break
            now = time.monotonic()  # (also the stats interval's clock below)
            if self.parent_gone(now):
                break
            if not self.has_work():
                if errors:
                    self.send(self.outputs_msg([], idle_seq=self.input_seq, errors=errors))
                continue
            sim_now = self._sim_now() if (self.pace and not busy) else None
            busy = True
            result = engine.step()
            self.num_steps += 1
            st = result.stats
            if st is not None:
                pcs = st.prefix_cache_stats
                self.prefix_queries += pcs.queries
                self.prefix_hits += pcs.hits
            release_at = sim_t = 0.0
            if self.pace:
                release_at, sim_t = self._pace(result, sim_now)
            elif self.clock is not None:
                sim_t = self.clock.on_step(result) or 0.0
            if result.outputs or errors or now - last_stats > IDLE_STATS_INTERVAL_S:
                t0 = perf()
                idle = -1 if self.has_work() else self.input_seq
                self.send(self.outputs_msg(result.outputs, idle, errors, release_at, sim_t))
                self.ipc_profile.append((len(result.outputs), perf() - t0, t_in))
                last_stats = now
                if idle >= 0:
                    busy = False

    # -- MoE data parallelism ---------------------------------------------------------------------
    def start_lockstep(self, group: Any) -> None:
        """Step in lockstep with the other DP ranks of `group` (an MoE model; core/engine/dp_lockstep.py)."""
        from servetwin.core.engine.dp_lockstep import DPLockstep  # noqa: PLC0415

        self.lockstep = DPLockstep(group)

    def _send_idle_if_new(self) -> None:
        """Tell the client that every input so far is done (it waits for that), once per input number."""
        if not self.has_work() and self.input_seq > self.idle_sent_seq:
            self.idle_sent_seq = self.input_seq
            self.send(self.outputs_msg([], idle_seq=self.input_seq))

    def run_lockstep(self) -> None:
        """vLLM's `DPEngineCoreProc.run_busy_loop` (`core.py:2465-2552`): while the wave runs, one step per
        iteration - the engine's, or a dummy batch when it executed nothing - then the step barrier and the
        every-16-steps check whether any rank still has unfinished requests."""
        ls = self.lockstep
        self.last_parent_check = time.monotonic()
        while self.running:
            waiting = not self.has_work() and not ls.engines_running
            errors = self.handle_inputs(int(PARENT_CHECK_INTERVAL_S * 1000) if waiting else 0)
            if not self.running:
                break
            if self.parent_gone(time.monotonic()):
                break
            if errors:
                self.send(self.outputs_msg([], idle_seq=-1 if self.has_work() else self.input_seq, errors=errors))
            if not self.has_work() and not ls.engines_running:  # every rank is idle
                self._send_idle_if_new()
                continue
            num_tokens = self._lockstep_engine_step() if self.has_work() else 0
            if num_tokens == 0:
                self.engine.executor.execute_dummy_batch()
                ls.dummy_batches += 1
            ls.step_barrier(num_tokens)
            if not ls.has_global_unfinished(self.engine.scheduler.has_unfinished_requests()):
                wave = ls.end_wave()
                if ls.rank == 0:
                    self.send(self.m.OutputsMsg([], self.stats(), wave_complete=wave))
            self._send_idle_if_new()

    def _lockstep_engine_step(self) -> int:
        """One engine step and its outputs; the number of tokens its forward ran (0: none)."""
        result = self.engine.step()
        self.num_steps += 1
        st = result.stats
        if st is not None:
            self.prefix_queries += st.prefix_cache_stats.queries
            self.prefix_hits += st.prefix_cache_stats.hits
        sim_t = (self.clock.on_step(result) or 0.0) if self.clock is not None else 0.0
        if result.outputs:
            idle = -1 if self.has_work() else self.input_seq
            self.send(self.outputs_msg(result.outputs, idle, sim_t=sim_t))
            if idle >= 0:
                self.idle_sent_seq = idle
        so = result.scheduled
        return 0 if so is None else so.total_num_scheduled_tokens

    def close(self) -> None:
        for sock in (self.input, self.output):
            try:
                sock.close()
            except Exception:  # noqa: BLE001
                pass
        try:
            self.ctx.term()
        except Exception:  # noqa: BLE001
            pass


def run_engine_core(args: Any, input_addr: str, output_addr: str, parent_pid: int,
                    pace: bool = False, time_scale: float = 1.0,
                    fake_step_time_s: Optional[float] = None, dp: Any = None) -> None:
    """Body of the EngineCore process (`main()` reads these arguments from standard input)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides; it shuts us down

    def _term(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _term)
    try:
        import setproctitle  # type: ignore  # noqa: PLC0415

        setproctitle.setproctitle(f"servetwin::EngineCore({args.backend})")
    except ImportError:
        pass
    proc: Optional[EngineCoreProc] = None
    try:
        from servetwin.core.engine.engine_factory import create_engine_core  # noqa: PLC0415

        try:
            engine, info = create_engine_core(args)
            if fake_step_time_s is not None and args.backend == "fake":
                info.executor.step_time_s = float(fake_step_time_s)
            dp_group = _join_dp_group(args, info, dp)  # blocks until every rank has joined
        except BaseException as e:  # noqa: BLE001 - report any start-up failure to the parent
            _send_startup_error(output_addr, e)
            sys.exit(1)
        proc = EngineCoreProc(engine, info, args, input_addr, output_addr, parent_pid, pace=pace,
                              time_scale=time_scale)
        if dp_group is not None:
            proc.start_lockstep(dp_group)
        from servetwin.core.gc_heap import freeze_gc_heap  # noqa: PLC0415

        freeze_gc_heap()  # the engine, model and executor leave the collector's full passes (vLLM does too)
        proc.send_ready()
        try:
            proc.run()
        except Exception as e:  # noqa: BLE001
            from servetwin.core.engine import messages as m  # noqa: PLC0415

            proc.send(m.EngineErrorMsg(type(e).__name__, str(e), traceback.format_exc()))
            raise
    finally:
        if proc is not None and proc.lockstep is not None:
            try:
                proc.lockstep.group.close()
            except Exception:  # noqa: BLE001 - a peer may be gone already
                pass
        if proc is not None:
            close = getattr(proc.engine.executor, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:  # noqa: BLE001
                    pass
            proc.close()
            if not proc.parent_alive():
                _remove_socket_dir(input_addr)  # the front end died and cannot clean up its temp dir


def _join_dp_group(args: Any, info: Any, dp: Any) -> Any:
    """The DP group of an MoE model's rank (`dp`: its `DPRankInfo`), when its backend has one; None: a
    dense model or one DP rank (vLLM runs those as independent engines, `core.py:1546-1555`)."""
    if dp is None or dp.size < 2 or not info.is_moe:
        return None
    from servetwin.core.engine.executor import executor_backend  # noqa: PLC0415

    init = executor_backend(args.backend).init_dp_group
    return None if init is None else init(dp)


def _remove_socket_dir(addr: str) -> None:
    import shutil  # noqa: PLC0415

    if addr.startswith("ipc://"):
        d = os.path.dirname(addr[len("ipc://"):])
        if os.path.basename(d).startswith("servetwin-engine-"):
            shutil.rmtree(d, ignore_errors=True)


def _send_startup_error(output_addr: str, e: BaseException) -> None:
    import zmq  # noqa: PLC0415

    from servetwin.core.engine import messages as m  # noqa: PLC0415

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.connect(output_addr)
    sock.send(m.encoder().encode(m.StartupErrorMsg(error_kind(e), str(e), traceback.format_exc())))
    sock.close()
    ctx.term()


def main() -> None:
    """`python -m servetwin.core.engine.engine_proc`: the arguments of `run_engine_core`, pickled on stdin."""
    import pickle  # noqa: PLC0415

    payload = pickle.load(sys.stdin.buffer)
    sys.stdin.close()
    run_engine_core(**payload)


if __name__ == "__main__":
    main()
