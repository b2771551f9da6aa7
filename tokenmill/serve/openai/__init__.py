"""The OpenAI-compatible HTTP server (`tokenmill serve`); needs the `serve` extra."""
