"""Network entry points (the OpenAI-compatible HTTP server)."""
