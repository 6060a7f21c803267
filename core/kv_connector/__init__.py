"""KV connectors, scheduler side (vLLM 0.33 `distributed/kv_transfer/kv_connector/v1/`): the API the
scheduler calls (`base`, `config`), the P/D connector (`nixl`), the offloading connector and its CPU
tier (`offloading`, `cpu_tier`), the factory with its plugin entry point (`factory`) and the
scheduler's connector paths (`scheduler_hooks`)."""
