"""Serving: the engine in its own process, data-parallel replicas, the async front and the OpenAI-compatible
HTTP server. Above engine/ (the step core); below entrypoints/ (the CLI and the LLM class)."""
