"""Model loading: HF directories, GGUF files and dummy presets, all streaming to the target device."""

from tokenmill.loader.load import LoadedModel, load_model

__all__ = ["LoadedModel", "load_model"]
