"""The model runner (after vLLM's Model Runner V2): persistent request state, device-side input
preparation, sampling and post-update, async outputs, CUDA graphs. Never imports the engine."""
