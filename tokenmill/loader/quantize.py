"""Quantization at load: which method a model gets (the engine's option, a checkpoint's
`quantization_config`), and quantizing its linear layers."""

from typing import Optional

import torch

from tokenmill.errors import ModelLoadError
from tokenmill.layers.linear import LinearBase
from tokenmill.logger import init_logger
from tokenmill.quantization import QUANTIZATION_METHODS

logger = init_logger(__name__)


def resolve_quantization(requested: Optional[str], hf_config: dict) -> Optional[str]:
    """The method to apply after loading (None: none). A checkpoint that is itself quantized is
    refused, naming its method: tokenmill quantizes full-precision checkpoints only (so far)."""
    checkpoint = hf_config.get("quantization_config")
    if checkpoint is not None:
        method = checkpoint.get("quant_method") if isinstance(checkpoint, dict) else None
        raise ModelLoadError(f"the checkpoint is quantized (quant_method {method!r}); tokenmill loads full-precision "
                             f"checkpoints and quantizes them itself (quantization={', '.join(QUANTIZATION_METHODS)})")
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ModelLoadError(f"quantization method {requested!r} is not supported "
                             f"(supported: {', '.join(QUANTIZATION_METHODS)})")
    return requested


@torch.no_grad()
def quantize_model(net: torch.nn.Module, method: str) -> int:
    """Quantize every linear layer of the decoder (the embedding and the LM head stay as they are);
    returns how many."""
    assert method == "fp8", method
    layers = [m for m in net.modules() if isinstance(m, LinearBase)]
    before = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    for m in layers:
        m.quantize_fp8()
    after = sum(m.weight.numel() * m.weight.element_size() + m.weight_scale.numel() * 4 for m in layers)
    logger.info("fp8: %d linear layers quantized, %.2f GB -> %.2f GB", len(layers), before / 1e9, after / 1e9)
    return len(layers)
