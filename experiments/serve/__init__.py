"""`servetwin serve`: the OpenAI-compatible HTTP server."""
