"""Errors a user can act on. Each names the problem in its message."""


class TokenmillError(Exception):
    """Base class of tokenmill's own errors."""


class ModelLoadError(TokenmillError):
    """A model could not be found, read or understood."""


class UnsupportedArchitectureError(ModelLoadError):
    """The config names an architecture tokenmill does not implement."""


class InvalidRequestError(TokenmillError, ValueError):
    """A request or its sampling parameters are invalid."""


class LoRAError(InvalidRequestError):
    """A LoRA adapter could not be loaded or used (a bad directory, an unsupported option, a rank
    above max_lora_rank, a module the model lacks); or LoRA is not enabled."""
