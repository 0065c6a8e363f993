"""`qrt serve`: an OpenAI-compatible HTTP server with continuous batching over a CompiledModel."""
