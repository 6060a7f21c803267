"""Cluster simulation speed: the 16-instance, 16-stage routing ladder vs the single-engine bench run.

Runs, as whole fresh processes of this checkout (`sim_speed_process.run_process`: `servetwin run`, wall
and CPU seconds, peak RSS of the process tree from `wait4`), interleaved `--repeats` times:
- the cluster: benchmarks/published_cluster/cases/routing_gptoss120b_h100_16xtp1_llmd.yaml (16 x
  gpt-oss-120b behind llm-d routing, the warm-up stage and 16 Poisson stages, 17,084 requests) - and, with
  `--both-arms`, the round-robin arm too (together the ~30k requests of issue 35's target);
- the single engine: experiments/configs/bench_h100_llama8b.yaml (10,000 requests).
It prints wall seconds per request (whole process, and the simulation loop alone), peak RSS, and the
cluster / single ratio against issue 35's targets: <= 1.5x the wall time per request, < 2 GB.

`--profile N`: cProfile the cluster config in this process, cut to its first N requests (the stages keep
their counts, so N must be a stage boundary: 810 = the warm-up and the first stage, 1,010, 1,310, 2,070,
...), and print the functions with the most cumulative and own time.

**Now** (quiet, the twenty-second session, 2026-12-07, `--both-arms --repeats 3`; no simulation change since the
twenty-first, whose table follows; the host ran faster):

| run (UTC) | single wall ms / req | llm-d wall ms / req | round robin wall ms / req | llm-d / single | round robin / single | both arms / single |
|---|---:|---:|---:|---:|---:|---:|
| 01:24 (main 1761cfc) | 0.63 | 0.85 | 0.88 | 1.34x | 1.39x | 1.37x |
| 02:29 (main 1dc528f: the cluster summary's binding, SLOs and steady state added to the output phase) | 0.69 | 0.88 | 0.89 | 1.27x | 1.29x | 1.28x |

Peak RSS 875 / 807 MB. Round robin's run, timed by hand: start-up 0.8 s, loop 11.4 s (each worker waits 0.4-1.1 s at
stage ends, both about equally; the busier half's routed requests, summed over the stages, are 8,713 against an
even split's 8,542, so balancing the instances by their counts would save <= ~0.25 s), worker 1's shipment 0.75 s, output phase 2.8 s (~6 s CPU over three
processes on two cores).

The twenty-first session (quiet, 2026-12-06/07: a routing cluster's engines split over two forked worker
processes, `cluster.sim_workers: auto`, sim/cluster_parallel.py, docs/cluster.md; every output file of both ladders
byte-identical to the one-process run, `benchmarks/outputs_identical.py --full`; `--check-windows 2070` the same
digest, e69dedcc2a441bc3), `python benchmarks/cluster_speed.py --both-arms --repeats 3` at 23:40 and 00:03 UTC
(medians of 3; the host's speed drifted: the same single run took 0.73 / 0.80 ms):

| run (UTC) | single wall ms / req | llm-d wall ms / req | round robin wall ms / req | llm-d / single | round robin / single | both arms / single |
|---|---:|---:|---:|---:|---:|---:|
| 23:40 | 0.73 | 0.94 | 1.18 | 1.30x | 1.63x | 1.45x |
| 00:03 | 0.80 | 0.97 | 1.15 | 1.22x | 1.45x | 1.33x |

In the loop 1.31-1.42x (llm-d) and 1.61-1.89x (round robin); the CPU of the process tree 1.76-1.82x and 2.07-2.27x
(the workers replicate the arrivals and the router, and wait for each other at meetings). Peak RSS of the largest
process 879-926 MB (llm-d); the two workers' proportional set size together peaked at 1,094 MB against 1,112 MB for
the one-process run (`--set cluster.sim_workers=1`; their RSS summed, shared pages counted twice: 1,937 / 2,088 MB).
Target <= 1.5x: met by the llm-d ladder in both runs and by the two arms together (the ~34k requests of the issue's
"about 30k"); the round-robin arm alone is 1.45-1.63x.

How (docs/cluster.md, "Simulating on several CPUs"): each worker simulates its own instances and a replica of the
arrivals and the router; the workers meet before a routing decision, exchanging the router's news (first tokens,
ends, scraped metrics), unless the router proves its pick from what every replica shares (`forced_pick`), and at
each stage's end. First tried: a meeting at every decision (17,101 on the llm-d ladder): each worker then waited
~5 s of its ~19 s loop on the other (the admission work after an arrival falls on one side: at each meeting one
waits; both waiting at once summed to 0.23 s), and the loop took 19.2 s against ~20 s in one process - no gain.
With the proven picks: llm-d 167 meetings (the warm-up's 750 new prompts and the stage ends), random 17 (the stage
ends): loops of 11.2-14.3 s (llm-d) and 12.7-17.3 s (round robin) against ~20 s and ~26 s in one process; each
worker's CPU in the loop 10-13 s, waits 0.4-2.2 s at stage ends (the random arm's stages load its two halves
unevenly). After the loop, worker 1 ships its 8 engines to worker 0 (recorders packed, one message each: ~99 MB,
~1.2 s from the loop's end to the last engine unpickled), then the output phase as before (~2.7 s).

Before (the twentieth session's main, one process), `python benchmarks/cluster_speed.py`; the host's speed drifted between runs: the single
engine took 0.62-0.75 ms wall per request: after the twentieth session's second round, 21:07 (`--repeats 3`) and
21:10 UTC (`--repeats 2`): single 0.75 / 0.73 ms, cluster llm-d 1.40 / 1.24 ms wall per request (18.3-20.1 s in the
loop, 22.0-24.5 s in all; 961-977 MB): **1.88x / 1.69x the wall time per request** (2.29x / 2.03x in the loop, 1.71x /
1.55x the CPU); after its first round, 20:31 UTC (`--repeats 2`): single 0.62, cluster 1.13 ms: 1.81x. The session's
start, main eb10c77 (`--repeats 1`): 2.12x at 19:25 UTC (single 0.67, cluster 1.42 ms) and 2.42x at 21:09 UTC, between
the two runs above (single 0.64, cluster 1.55 ms). Both arms (`--both-arms --repeats 1`, 21:30 UTC, the final main): single 0.81 ms, llm-d 1.21 ms (1.51x), round robin 1.78 ms (2.21x; not profiled: its prompts spread over every engine, so more prefill and prompt-hash misses per request are the likely cause), the two together 1.85x. Then the engines of a cluster shared their prompt memos (`share_prompt_memo`: a prompt sent to several engines is hashed once; round robin sends each prompt to all 16): the round-robin arm's `simulate_cluster` 18.8 / 21.1 s CPU against 20.2 / 22.8 s before (interleaved, quiet, -7%); `--both-arms --repeats 1` at 21:38 UTC: single 0.60 ms, llm-d 1.07 ms (1.78x), round robin 1.33 ms (2.21x). The target of 1.5x is not met; RSS is. What changed, every output file of the bench and the whole ladder
byte-identical to eb10c77 (`benchmarks/outputs_identical.py --full`), `--check-windows 2070` equal:
- step windows run on while a request's ingress is on the API server's CPU (sim/frontend.py `outputs_deferrable`,
  `outputs_at`: the window's outputs handed to the front end at its wake-ups and arrivals, the wake-ups between them
  replayed at their times without a SimPy event each); a request reaching the front end no longer cuts the window.
  First 6,573 requests: window plans refused by the front end 9,379 -> 0, SimPy events -23%, fused steps -26%;
- a request keeps no copy of its prompt (`Request.all_token_ids` built on its first read; the scheduler and the block
  hashers read the prompt and output lists), the prefix-cache map keeps each key's first block;
- a pure decode batch priced from its batch size's cached parts (`CostModel.predict`), `StepSummary` a plain slots
  dataclass, the decode row's texts cached;
- window commits: the members' first terminal event in a heap, one due member without a sort, a KV fit check
  without the window frees first, a window's trace rows straight to the columns, `DeliveryMap` without its dict;
- output phase: the steps tables built and written by a second forked child, both ITL arrays in one pass;
- the router's prefix walk counts runs of equal holder sets;
- (second round) a front-end arrival or wake-up gets the window's outputs alone (`Simulation._window_give`): the
  window's scheduling and trace rows wait for its close or cut, in fewer, larger calls (first 6,573 requests:
  window commits 34,240 -> 16,556, function calls -2.5%); trace.json's texts written without a copy each.
Measured and left out (within noise): deferring a wake-up that only completes an ingress (SimPy events -5%, CPU
the same), a fast path for the hybrid prefix-cache lookup (~0.3% of the loop), the requests' trace events as text
(the trace.json child is no longer the output phase's longest process), a repeated-value step-table column.
Sampled profile of the loop after the first round (py-spy, 200 Hz): normal steps 28.7% (61,798: an admission, the step after it with
the first token, the step that processes the second, the last token - each with one listed row's real work), window
commits 28.1% (now including the outputs handed over at the front end's arrivals and wake-ups), routing and dispatch
17.8%, fused steps 7.3%; self time led by the step table's column conversion (`StepTable._extend` 6.5%: memory-bound,
a repeated-value column measured no faster), the output blocks' hashes (`request_block_hasher` + `sha256` 5.2%),
young GC collections (~0.5 s CPU over the loop: 6 of them, each scanning the 50-110k objects that survive: trace
and KV state, not garbage). What is left to 1.5x (-18% in all) is spread over functions of a few % each.

Before that (quiet, 2026-12-06 18:12 UTC, the nineteenth session's final main: a window's and a
fused step's member KV events done in place without `schedule()` (`SimScheduler._in_place_step`), a window priced
in one loop, the step after a finish fused (its finished ids handed to the runner), prompts' block hashes and salts
kept per prompt list for the run (core/prompt_memo.py), one SamplingParams per workload setting, cheaper KV
admission and member KV work (core/kv_cache), trace rows buffered across windows, the router's keys kept per prompt
list; every output file of the bench and the whole ladder byte-identical to c4c88d0, `benchmarks/outputs_identical.py`;
`python benchmarks/cluster_speed.py --repeats 3`, and `--repeats 2` at 17:40): single 0.59-0.66 ms wall / 0.72-0.82 ms CPU
per request (276 MB), cluster llm-d 1.32-1.44 ms wall / 1.45-1.57 ms CPU (1,131 MB; 17.7-20.6 s in the loop,
21.3-24.8 s in all): **2.18-2.25x the wall time per request** (2.66x in the loop, 1.92-2.02x the CPU), from
2.84-2.94x; the target of 1.5x is not met, RSS is. Whole-ladder cProfile now (39 s, 49.7 M calls; 56 s, 81.7 M at
the session's start): normal steps 13.0 s (61,798 of them, 3.6 per request: an admission, the two steps after it,
the last token; 75,068 before), window commits 8.3 s, window plans and extensions 3.8 s, fused steps 4.3 s,
routing 2.7 s, admissions' own work 1.2 s. Measured and not merged: fusing the second step after an admission
(normal steps 61,798 -> 48,032, the same function calls -4.7%) changed the ladder's CPU by -1.5% against a
spread of +-4% over three interleaved runs (18:07 UTC, quiet): the work of those steps moves, it does not go.

Before (quiet, 2026-12-06 15:24-15:34 UTC, the eighteenth session's merges): single 0.60-0.62 ms wall, cluster
llm-d 1.72-1.83 ms wall (25.6-29.4 s in the loop): 2.84-2.94x.

History (2026-12-06, the shared 2-core machine, under load: ratios, not results): the ladder ran at ~100x the
single engine's wall time per request while gpt-oss's sliding-window group kept implicit decodes off; ~8x
CPU per request once they handled windows (every engine runs implicit decodes since); 7.1x CPU / 9.6x wall
at 09:31 (`--repeats 1`). (Until then the script passed `--requests 17084`, which redraws the shared-prefix
workload as 3,416 groups instead of the ladder's 150 cycled: a different run; it runs the config's own.)

Quiet (2026-12-06, nothing else running, load about 1 at the start, `python benchmarks/cluster_speed.py --repeats 2`, 13:11 UTC): single 0.65 ms
wall / 0.79 ms CPU per request (276 MB), cluster llm-d 2.72 ms wall / 2.71 ms CPU per request (1,163 MB; 39.3 s in
the loop, 48.2 s in all): **4.22x the wall time per request** (4.96x in the loop, 3.42x the CPU) against the
target of 1.5x, not met; RSS met. Steps on the way (all quiet, `--repeats 1`): 9.16x (5.79 ms) with 16-token
blocks before the fused step; 5.30x (3.62 ms; 61.9 s in all, 39.4 s in the loop) after it and the routing cases'
move to the guide's 128-token blocks (fewer KV events per step, so more steps fuse; the fused step alone measured
-14 to -17% CPU on the whole ladder, below); 4.22x once trace.json's step events were written as text
(core/testbed/perfetto.py `_engine_event_texts`: the same bytes, checked on this ladder's 251 MB file; the run
outside the loop 22.5 -> 9 s). Under cProfile the cluster run before that last change (118 s) split: simulation
97 s (fused steps 46 s, of which the API server's output message 16 s; normal steps 19 s; routing 5 s),
trace.json 16 s (1.5M step events).

Where the time goes (`--profile 810`; call counts are load-independent): 127,235 engine steps for the first
810 requests, 126 per request (the single-engine bench: 3): the 16 engines hold ~4 requests each and 98% of
steps list no row (every running request an implicit member); one step in ~6 has a member KV event (a
new block, a block registered, a window's drop), done in place.

The fused implicit-decode step (this session, sim/engine.py `Simulation._fused_step`): a step whose batch
is the implicit members alone - no member event (`LazyDecodes.quiet_step`), or only KV events done in place
(`SimScheduler.quiet_step` schedules it in full) - with nobody waiting, nothing finished or preempted, is
scheduled, priced (`CostModel.decode_duration`: the batch size's terms cached, the attention terms and
`predict`'s sum redone, the same float), recorded (`TraceRecorder.on_implicit_step`, the row without
per-value checks) and handed to the front end without `SchedulerOutput`, stats, runner output or
`StepResult`; in async scheduling its batch joins the engine's queue only when a normal step needs it.
Exact: tests/sim/test_sim_fused_step.py (single engine, Hypothesis: sync/async, caching, windows, small
pools, API server, client timeouts, cut runs; `decode_duration` == `predict`), test_sim_cluster_speed.py
(a cluster equals its step-by-step run), and a digest of the ladder's first 810 and 2,070 requests -
decisions, completions, every engine's step / request rows and ITLs - equal to the previous checkout's.
- 810 requests: 123,593 of 127,235 steps fused (102,046 with no member event, 21,547 with KV events in
  place; 3,882 normal: admissions, last tokens); function calls 33.70 M -> 26.51 M; CPU of
  `simulate_cluster` 10.1 s -> 6.3-7.8 s (one after the other, load 4-11). 2,070 requests: 302,089 of
  311,677 steps fused; 29.9 -> 19.4 s CPU (the two checkouts at the same time, load 4-7).
- the whole ladder (774,471 steps now: the cost terms changed since 09:31), the previous checkout and this
  one as concurrent `servetwin run` processes: 137.3 -> 118.6 s CPU (-14%; 12:00, load 7-10) and 159.6 ->
  133.1 s (-17%; 12:16, load 3-6; in the loop 368.8 -> 298.9 s), peak RSS 1,273 -> 1,266 MB; the single
  engine's bench the same way right after: 11.9 / 11.9 s CPU (not slower; its outputs byte-identical, its
  function calls under cProfile 20.13 M -> 20.03 M). Per request: 7.8 ms CPU for the ladder against 1.2 ms
  for the bench, 6.5x (7.9x before). `--repeats 1` (11:48-11:53, load 4-10):
  single 1.09 ms CPU / 2.49 ms wall per request, cluster 6.83 / 11.41: 6.3x the CPU, 4.6x the wall (the
  single run's wall inflated by the load). The target of 1.5x is not met; the RSS target is.
- per fused step what is left (cProfile shares at 810): the API server's output message (`on_step_output`:
  the shared CPU's job add / completion / delivery, ~25%), the scheduler's checks and aggregates, the trace
  row, the cost model, one SimPy timeout and the engine loop's checks - each step is still one event.

Outside the loop (2026-12-06 14:10-14:45, the shared 2-core machine under load 1-5: CPU seconds of
whole `servetwin run` processes, measured back to back with a wrapper timing `ClusterSimulation.run` and
`main`; no quiet wall figure). Before, at load ~1: 40.9 s in all, 32.9 s in the loop, ~8 s outside it, all
in one process: start-up 0.6 s (imports 0.23 s, engines and workload 0.2 s), then 7.2-7.4 s CPU of output
work - trace.json 3.5 s (1.5M step events: rounding and repr of their 2.3M floats 1.4 s, `%` formatting 1
s; the requests' and router's dicts, encoding and writing 1 s), the ITL arrays 0.8 s, the tables as frames
0.7 s (pandas' import in it) and as Parquet 0.55 s, the engines' summaries 0.5 s, the cluster's 0.35 s, the
router decisions 0.3 s (a full GC pass over the simulation's objects fell there: ~0.3 s each) - and the
interpreter's exit 0.55-1.1 s (collecting the simulation's reference cycles). Now
(experiments/run/cluster_run.py `_write_outputs`): trace.json is written by a forked child while the
parent builds the tables and summaries; its step events are formatted in C loops over parts cached by
value, the times by '%.3f' (core/testbed/perfetto.py `_step_texts`, `_us_texts`: 3.5 -> 2.0 s for the
file); the simulation's objects are frozen out of the GC for the output phase (experiments/run/background.py
`frozen_heap`) and left to the OS at exit (experiments/cli.py `_leave_the_heap_to_the_os`). Two pairs at
load 2.6-4.6: the output phase 7.41 / 7.21 s CPU in one process -> 3.21 / 3.14 s in the parent and 2.08 /
2.11 s in the child (5.3 s in all, -28%; the parent's, the critical path on two free CPUs, -57%); the
exit ("wrote" -> process end) 0.78 / 1.10 -> 0.19 / 0.17 s; peak RSS 1,160 -> 1,100 MB. Under that load
the wall outside the loop barely moved (9.1 / 12.6 -> 9.1 / 8.7 s: the child found no free CPU). Every
output file is the same bytes (benchmarks/outputs_identical.py against 8b47cd0: both configs cut short and
`--full`, the 251 MB trace.json included; the P/D and CPU-offload cases cut short with figures). What the
parent still does (3.1 s CPU under load), all in the recorder (core/testbed/trace.py, step_table.py):
frames 0.7 s (pandas' import ~0.4 s), ITL arrays 0.8 s (`DeliveryMap.client_times` converts its lists to
arrays and searches every token's time: ~0.7 s of it), Parquet 0.55 s, summaries 0.5 s. The single-engine
bench, outside its loop (~2.3 s of 6.5 s, quiet 14:11): start-up 0.5 s, its output phase 1.6 s (already in
a prewarmed child and forked writers: the four figures the longest), exit 0.14 s; unchanged by this (its
trace.json has 30k steps: children's CPU 2.55 -> 2.48 s).

What remains, and a way there (not built): most steps must not be events. Over the whole ladder 57% of the
774,471 steps are fused with no member event, 33% fused with KV events in place (full scheduling pass) and
10% normal (admissions, last tokens: the later stages hold more requests per engine); an engine runs 27
fused steps in a row on average (83-91 on the first 810 / 2,070 requests) but only 3.7 (5.6-6) without a
member KV event; so a window must span in-place KV events. Per engine: plan its fused
steps ahead (durations depend on the batch: k, the sum of contexts growing by k a step, shared KV constant
unless a window drops a shared block) and commit them - KV work, rows, front-end outputs - only when an event
of this engine interrupts or the window ends; one SimPy event per window. What exactness needs, found here:
(a) the API server's shared CPU reads `env.now` (`on_step_output`, `_output_done`'s delays, `_schedule_wake`):
outputs must be fed with explicit times, and every access to it (a dispatch's ingress job, its wake timers,
an ingress completing) must commit the window up to now first; (b) the router's 50 ms scrapes read KV usage,
which in-place allocations and window drops change: answer them from the plan's per-step free-block counts
(or commit up to the scrape); (c) SimPy's clock: one timeout for a window must land on the float the chain
of per-step timeouts reaches (t + d0 + d1 ..., each rounded): pick the delay so that `now + delay` equals
it; (d) a planned step end at exactly another event's time is ordered by event id in the step-by-step run:
cut the window before such a tie. Each proven against the step-by-step run as test_sim_cluster_speed.py does.

Step windows (built since, "Stage B" in its simplest exact form; sim/engine.py `Simulation._plan_window`,
`SimScheduler.quiet_run`): after a fused step, the run of fused steps ahead with no member event at all (up
to 256; `LazyDecodes.quiet_run`) is priced at once (`CostModel.decode_durations`) and the engine waits for
the last one's end as one SimPy event; the per-step actions in between (the step counters, the trace rows
`TraceRecorder.on_implicit_steps`, the previous batch's outputs `ApiServerFrontend.on_step_outputs_at`) are
applied with each step's own times when the window ends, or up to now when a request reaches the engine
first (a submit to it or to its front end, a wake-up: `_window_cut`; the window then ends with the step in
progress, its engine woken by a second timeout, the first one left to fire for nothing). Only with no
step-boundary hook (DP coordinator, KV events), KV worker, drafter, client timeout or abort pending, no
`max_time_s`, a front end holding no important job and no wake-up due in the window (`quiet_until`; since the
twentieth session an ingress in service no longer stops a window: `outputs_deferrable`); in
async scheduling, or sync without a front end. The four conditions: (a) the front end gets each step's
outputs with its time, and every access to it cuts first; (b) scrapes need nothing: inside a window
waiting, running and KV usage do not change (no admission, finish or KV event), which the cluster test
checks with 5 ms scrapes; (c) `_delay_to` picks the delay whose `now + delay` is the last step's end;
(d) ties need no order here: the step-by-step engine settles before scheduling at a step end (everything
else at that time first, what a cut leaves to the woken engine) and, in async scheduling, hands the
previous batch's outputs over then too; in sync scheduling it hands them over before settling, at a
position the event ids decide, so no sync windows with a front end. Exact: tests/sim/test_sim_step_windows.py
(Hypothesis, windows on vs off: single engines sync/async, offline / API server / two in-order servers,
client timeouts, small pools, sliding windows; clusters behind four routers, Poisson and stage arrivals,
5 / 50 ms scrapes) and `--check-windows N` (a digest of the decisions, completions, every engine's step and
request rows, ITLs and deliveries; equal at 810, 2,070 and all 17,084 requests, and equal to the previous
checkout's at 810 and 2,070).
- `--profile 2070`, one after the other (load 2-3, cProfile): the checkout before (8b47cd0) 44.35 M function
  calls, 23.8 s; main with the bulk primitives, no windows: 29.45 M, 18.5 s; with windows 17.84 M, 11.4 s.
  297,449 of its 312,221 steps in 11,955 windows (95.3%, 24.9 steps a window; 810 requests: 95.6%, 27.5);
  SimPy events 337,695 -> 67,343.
- the whole ladder: 652,218 of 758,763 steps in 62,871 windows (86.0%, 10.4 steps a window: the later stages
  hold more requests per engine, so member events come sooner); `simulate_cluster` 34.1 -> 28.9 s CPU (off /
  on, one after the other, load 2-3). `--repeats 1` at load 3.6-4.9 (a ratio under load, not a result):
  3.41x the wall time per request, 2.89x the CPU (single 0.78 ms CPU, cluster 2.25 ms), 1,186 MB.
- what is left (cProfile of the whole ladder, 118 s): normal steps 31 s (admissions, last tokens), fused
  steps with member KV events in place between windows 21 s, routing 15 s (the prefix-cache filter's block
  keys), the windows' commits 18 s (per step still: the front end's output job on its shared CPU - add,
  advance, done - and the trace row's values) and plans 6.6 s. Next: the front end's jobs of a window's equal
  outputs in closed form; windows across in-place KV events (their steps' KV usage for the scrapes:
  `_Instance.counts` would commit up to the scrape); sync windows with a front end (ties ordered by when the
  arrival's event was created).

Windows across member KV events, lazy plans, cheaper commits (the second round, 2026-12-06 afternoon):
- windows span member KV events done in place (a new block, a full block registered, a sliding window's
  drop): `SimScheduler.quiet_run` counts the steps certain to stay quiet - before every member's terminal
  event (`LazyDecodes.in_place_run`), every allocation within the pool's free blocks now (at most
  cdiv(n, block_size) new blocks per member and KV cache group in n steps), no member holding a block
  shared with another request in a sliding-window group taking an event (a drop of it would change the
  shared KV tokens: the durations' input) - and the commit runs each event step's own `schedule()`
  (`SimScheduler.quiet_steps`: the KV work by the existing code; it raises if a step was not quiet after
  all), the trace rows taking each step's free blocks and usage; a cluster's scrape first schedules the
  window's steps before its time when a member event is among them (`Simulation.catch_up`: the KV usage as
  of then; the rows and outputs still at the window's end);
- plans price lazily: 32 steps first, then as many as the window has at its planned end while it is still
  quiet (`Simulation._window_extend`: one timeout, no engine step, no new plan); 2,070 requests: 388k
  steps priced for 298k used (644k when each plan priced all quiet steps, up to 256);
- the front end's output messages that run alone on its CPU (each done before the next step's: nearly all
  of a window's) in one pass (`SharedCPU.alone_finishes`: the same floats, no message, job or heap entry per
  step; test_sim_frontend_bulk).
Exact: tests/sim/test_sim_step_windows.py (new: Hypothesis with blocks of 1-8 tokens, sliding windows over
shared prefixes, pools with a few blocks to spare; a steady batch with blocks of 4 whose ~600 steps take a
few windows; the cluster test's 5 ms scrapes read the KV usage changing inside windows) and `--check-windows`:
equal at 2,070 and 17,084 requests, with the same digests as the checkout before (676f8d70..., 88fd3b6f...).
Numbers (under load 1.1-1.8, ratios and call counts, not results):
- 2,070 requests: 312,221 steps, 298,167 in 5,362 windows (95.5%, 55.6 steps a window; before 11,955 and 24.9);
  `--profile 2070` 17.84 M -> 15.61 M function calls, SimPy events 67,343 -> 58,290, 11.6 -> 9.6 s (one
  after the other); `--check-windows 2070` on/off CPU: before 4.8 / 6.5 s, now 4.3 / 6.2 s.
- `--profile 6573` (a later stage boundary, ~10 requests per engine; before the scrape change above): 43.84 M
  -> 40.39 M function calls, SimPy events 185,520 -> 155,492; fused steps outside windows 76,783 -> 55,953.
- the whole ladder: 665,341 of 758,763 steps in 31,797 windows (87.7%, 20.9 steps a window; before 86.0%,
  62,871, 10.4); `--check-windows 17084` windows on: 28.1 s CPU before, 26.8 s now (off 29.9 / 30.1; the
  final checkout 28.7 / 32.0 at a higher load: -10%).
  `--repeats 1` (15:10, load 1.5-1.8; before the scrape change), this checkout then the one before: single
  0.76 / 0.76 ms CPU per request, cluster 2.01 / 2.19 ms CPU: 2.65x / 2.88x the CPU, 2.69x / 3.24x the wall
  time per request (the single runs' wall 0.75 / 0.68 ms: load), 1,181 MB. The target of 1.5x is not met.
- what is left: the 12% of the ladder's steps outside windows - normal steps (admissions, last tokens:
  `step_engine`, 30,835 of them at 6,573 requests and the largest single cost there) and the fused
  steps around them; routing (the prefix-cache filter's block keys); per window step, the trace row and
  the front end's per-step arithmetic (both now one pass per window), and the event steps' `schedule()`.

Usage: python benchmarks/cluster_speed.py [--repeats 1] [--both-arms] [--profile 1060] [--check-windows 810 2070]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from sim_speed_process import run_process  # noqa: E402

CLUSTER = ROOT / "benchmarks/published_cluster/cases/routing_gptoss120b_h100_16xtp1_llmd.yaml"
CLUSTER_RR = ROOT / "benchmarks/published_cluster/cases/routing_gptoss120b_h100_16xtp1_rr.yaml"
SINGLE = ROOT / "experiments/configs/bench_h100_llama8b.yaml"
CLUSTER_REQUESTS = 17_084  # the ladder's requests (int(rate x duration) summed over its 17 stages)
SINGLE_REQUESTS = 10_000


def measure(repeats: int, both_arms: bool) -> None:
    configs = [("single", SINGLE, SINGLE_REQUESTS), ("cluster llm-d", CLUSTER, CLUSTER_REQUESTS)]
    if both_arms:
        configs.append(("cluster round robin", CLUSTER_RR, CLUSTER_REQUESTS))
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in configs}
    with tempfile.TemporaryDirectory(prefix="servetwin-cluster-speed-") as tmp:
        for i in range(repeats):
            for name, path, n in (configs if i % 2 == 0 else configs[::-1]):  # interleaved: drift hits all
                # the config's own workload (`--requests` would redraw the cluster's shared prefixes:
                # 3,416 groups of 5 instead of the ladder's 150 groups of 5 cycled)
                r = run_process(ROOT, path, None, [], tmp)
                r["requests"] = n
                runs[name].append(r)
                print(f"{name}: {r['wall_s']:.1f} s wall, {r['loop_s']:.1f} s in the loop, {r['cpu_s']:.1f} s CPU, "
                      f"{r['rss_mb']:.0f} MB peak RSS, {r['completed']} requests", flush=True)
    # CPU seconds too: on a loaded machine they move far less than wall seconds
    print("\n| run | requests | wall ms / request | loop ms / request | CPU ms / request | peak RSS MB |")
    print("|---|---:|---:|---:|---:|---:|")
    per = {}
    for name, rs in runs.items():
        n = rs[0]["requests"]
        wall, loop, cpu = (statistics.median(r[key] for r in rs) / n * 1000 for key in ("wall_s", "loop_s", "cpu_s"))
        rss = max(r["rss_mb"] for r in rs)
        per[name] = (wall, loop, cpu, rss)
        print(f"| {name} | {n:,} | {wall:.2f} | {loop:.2f} | {cpu:.2f} | {rss:.0f} |")
    base = per["single"]
    for name, (wall, loop, cpu, rss) in per.items():
        if name != "single":
            print(f"\n{name} / single: {wall / base[0]:.2f}x the wall time per request (target <= 1.5x), "
                  f"{loop / base[1]:.2f}x in the loop, {cpu / base[2]:.2f}x the CPU; peak RSS {rss:.0f} MB "
                  "(target < 2048)")


def profile(n: int, top: int) -> None:
    from servetwin.experiments.config.schema import load_config  # noqa: PLC0415
    from servetwin.experiments.run.cluster_run import simulate_cluster  # noqa: PLC0415

    exp = load_config(CLUSTER, values={"output.plots": False, "output.step_requests": False})
    exp = load_config(CLUSTER, values={"output.plots": False, "output.step_requests": False,
                                       "workload.arrival.stages": _stages_for(exp, n), "workload.requests": n,
                                       "cluster.sim_workers": 1})  # (one process: the profile sees every engine)
    prof = cProfile.Profile()
    prof.enable()
    simulate_cluster(exp)
    prof.disable()
    stats = pstats.Stats(prof, stream=sys.stdout)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)


def check_windows(n: int) -> bool:
    """The cluster config cut to its first n requests with step windows on and off (`Simulation(step_windows=
    False)` through the cluster's engine factory): a digest of the decisions, completions, every engine's step
    and request rows, ITLs and deliveries of each, whether they are equal, and the windows' share of steps."""
    import hashlib  # noqa: PLC0415
    import time  # noqa: PLC0415
    from unittest import mock  # noqa: PLC0415

    import pandas as pd  # noqa: PLC0415

    import servetwin.sim.cluster as cluster_module  # noqa: PLC0415
    from servetwin.experiments.config.schema import load_config  # noqa: PLC0415
    from servetwin.experiments.run.cluster_run import simulate_cluster  # noqa: PLC0415
    from servetwin.sim.engine import Simulation  # noqa: PLC0415

    exp = load_config(CLUSTER, values={"output.plots": False, "output.step_requests": False})
    exp = load_config(CLUSTER, values={"output.plots": False, "output.step_requests": False,
                                       "workload.arrival.stages": _stages_for(exp, n), "workload.requests": n})

    def digest(windows: bool) -> tuple[str, tuple[int, int, int], float]:
        factory = Simulation if windows else (lambda *a, **kw: Simulation(*a, **{**kw, "step_windows": False}))
        cpu = time.process_time()
        with mock.patch.object(cluster_module, "Simulation", factory):
            sim, runs, _, _ = simulate_cluster(exp)
        cpu = time.process_time() - cpu
        h = hashlib.sha256()
        h.update(repr([(d.request_id, d.t, d.pick, d.rank, d.candidates, d.scores) for d in sim.result.decisions])
                 .encode())
        h.update(repr(sorted(sim.result.completion_s.items())).encode())
        for label in sorted(runs):
            rec = runs[label].recorder
            frames = rec.frames()
            for name in ("steps", "requests"):
                h.update(pd.util.hash_pandas_object(frames[name], index=False).values.tobytes())
            h.update(repr(rec.itls()).encode())
            if rec.delivery is not None:
                h.update(repr([rec.delivery.client_time(t) for t in frames["steps"]["t_end_s"]]).encode())
        stats = [e.window_stats for _, _, e in sim.engine_runs()]  # (another worker's engines: as shipped)
        return h.hexdigest(), (sim.result.num_steps, sum(w for w, _ in stats), sum(k for _, k in stats)), cpu

    on, (steps, windows, in_windows), cpu_on = digest(True)
    off, _, cpu_off = digest(False)
    print(f"{n} requests: windows on {on[:16]} ({cpu_on:.1f} s CPU), off {off[:16]} ({cpu_off:.1f} s CPU): "
          f"{'equal' if on == off else 'DIFFERENT'}; {steps:,} steps, {in_windows:,} in {windows:,} windows "
          f"({in_windows / max(1, steps):.1%}, {in_windows / max(1, windows):.1f} steps per window)")
    return on == off


def _stages_for(exp, n: int) -> list[dict]:
    """The ladder's first stages holding exactly n requests."""
    out, total = [], 0
    for s in exp.workload.spec.arrival.stages:
        if total >= n:
            break
        out.append({"rate": s.rate, "duration_s": s.duration_s})
        total += s.count
    if total != n:
        raise SystemExit(f"--profile {n}: not a stage boundary of the ladder (the first stages hold {total})")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--both-arms", action="store_true", help="also the round-robin arm")
    ap.add_argument("--profile", type=int, metavar="N", help="cProfile the cluster's first N requests instead")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--check-windows", type=int, metavar="N", nargs="+",
                    help="compare the first N requests with step windows on and off instead")
    args = ap.parse_args(argv)
    if args.check_windows:
        if not all([check_windows(n) for n in args.check_windows]):
            raise SystemExit(1)
    elif args.profile:
        profile(args.profile, args.top)
    else:
        measure(args.repeats, args.both_arms)


if __name__ == "__main__":
    main()
