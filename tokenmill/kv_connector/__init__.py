"""KV connectors: move KV blocks between this engine's GPU cache and somewhere else (host memory, another engine)."""
