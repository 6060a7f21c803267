"""The worker side of the KV connectors in the torch backend (the scheduler side is core/kv_connector)."""
