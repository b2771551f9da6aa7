"""tokenmill: a compact, fast LLM inference engine."""

from tokenmill.version import __version__

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "LoRARequest",
           "__version__"]


def __getattr__(name):
    # Lazy, so that `import tokenmill` (e.g. for the CLI's --help) does not pay for torch.
    if name == "LLM":
        from tokenmill.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from tokenmill.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from tokenmill.structured_outputs import StructuredOutputsParams

        return StructuredOutputsParams
    if name == "LoRARequest":
        from tokenmill.lora.request import LoRARequest

        return LoRARequest
    if name in ("RequestOutput", "CompletionOutput"):
        from tokenmill.engine import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
