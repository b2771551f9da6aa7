"""Model loading: HF directories, GGUF files and dummy presets, all streaming to the target device."""

__all__ = ["LoadedModel", "load_model"]


def __getattr__(name: str):
    # On first use: the API server imports loader.hub (Hub ids) and never torch, which loader.load needs
    if name in __all__:
        from tokenmill.loader import load

        return getattr(load, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
