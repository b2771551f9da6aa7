"""The engine: requests, scheduling, the KV-cache manager and output processing."""
