"""The OpenAI-compatible HTTP server (`servetwin serve`)."""
