"""KV connectors, scheduler side (vLLM 0.33 `distributed/kv_transfer/kv_connector/v1/`): the API the
scheduler calls (`base`), the P/D connector (`nixl`), the CPU offloading tier (`offloading`) and the
factory with its plugin entry point (`factory`)."""
