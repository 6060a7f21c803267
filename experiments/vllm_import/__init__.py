"""Bring your own vLLM: read what vLLM (and SGLang's bench client) write, write it back.

- `bench_file`: `vllm bench serve` / `benchmark_serving.py` result JSON (`--save-result`,
  `--save-detailed`, `--append-result` JSONL, `vllm bench sweep`) and SGLang `bench_serving` JSONL,
  parsed once into `BenchRecord`s;
- `bench_case`: a `BenchRecord` as a `servetwin validate` case directory;
- `server_log`: the facts a vLLM server's startup log states (version, model, TP, KV blocks, ...);
- `profiler_trace`: Chrome traces with vLLM's `execute_context_X(a)_generation_Y(b)` step ranges, read
  into servetwin's step table and written from one;
- `bench_writer`: a servetwin run's results in `vllm bench serve`'s JSON shape.
"""
