"""Quantization at load: which method a model gets (the engine's option, a checkpoint's
`quantization_config`), and quantizing its linear layers."""

from dataclasses import dataclass
from typing import Optional

import torch

from tokenmill.errors import ModelLoadError
from tokenmill.layers.linear import LinearBase
from tokenmill.logger import init_logger
from tokenmill.quantization import QUANTIZATION_METHODS

logger = init_logger(__name__)


@dataclass(frozen=True)
class QuantizationPlan:
    method: str  # "fp8"
    from_checkpoint: bool  # the checkpoint stores FP8 weights and scales (else: quantized after loading)


# compressed-tensors "ignore" entries that name the LM head (which tokenmill never quantizes)
_LM_HEAD = ("lm_head", "re:.*lm_head", "re:lm_head")


def resolve_quantization(requested: Optional[str], hf_config: dict) -> Optional[QuantizationPlan]:
    """What to do about quantization (None: nothing). An FP8 checkpoint is read as stored:
    `quant_method` fp8 with per-tensor scales, or compressed-tensors float-quantized 8-bit weights
    with per-channel or per-tensor scales (static input scales are not used: activations are
    quantized per token at run time). Any other quantized checkpoint, block-wise FP8 scales
    included, is refused with a message naming what it is."""
    checkpoint = hf_config.get("quantization_config")
    if checkpoint is None:
        if requested is None:
            return None
        if requested not in QUANTIZATION_METHODS:
            raise ModelLoadError(f"quantization method {requested!r} is not supported "
                                 f"(supported: {', '.join(QUANTIZATION_METHODS)})")
        return QuantizationPlan(requested, False)
    method = checkpoint.get("quant_method") if isinstance(checkpoint, dict) else None
    if method == "fp8":
        if checkpoint.get("weight_block_size"):
            raise ModelLoadError(f"FP8 checkpoints with block-wise scales (weight_block_size "
                                 f"{checkpoint['weight_block_size']}) are not supported yet; per-tensor ones are")
    elif method == "compressed-tensors":
        _check_compressed_tensors(checkpoint)
    else:
        raise ModelLoadError(f"the checkpoint is quantized with quant_method {method!r}, which tokenmill does not "
                             f"load (it loads fp8 and compressed-tensors FP8 checkpoints, and full-precision ones)")
    if requested not in (None, "fp8"):
        raise ModelLoadError(f"quantization {requested!r} was asked for, but the checkpoint is already FP8")
    return QuantizationPlan("fp8", True)


def _check_compressed_tensors(cfg: dict) -> None:
    fmt = cfg.get("format")
    if fmt != "float-quantized":
        raise ModelLoadError(f"compressed-tensors format {fmt!r} is not supported (float-quantized is)")
    groups = cfg.get("config_groups") or {}
    if not groups:
        raise ModelLoadError("compressed-tensors config without config_groups")
    for name, group in groups.items():
        w = group.get("weights") or {}
        what = (w.get("num_bits"), w.get("type"), w.get("strategy"), w.get("symmetric", True))
        if what[:2] != (8, "float") or what[2] not in ("channel", "tensor") or not what[3]:
            raise ModelLoadError(f"compressed-tensors group {name!r}: weights {w} are not supported "
                                 f"(8-bit float, symmetric, per channel or per tensor are)")
        targets = group.get("targets") or []
        if targets != ["Linear"]:
            raise ModelLoadError(f"compressed-tensors group {name!r}: targets {targets} (only [\"Linear\"] is supported)")
    ignored = [i for i in cfg.get("ignore") or [] if i not in _LM_HEAD]
    if ignored:
        raise ModelLoadError(f"compressed-tensors ignore list {ignored[:3]}: layers left unquantized other than the "
                             f"LM head are not supported")


def expect_fp8_checkpoint(net: torch.nn.Module) -> None:
    """Make every linear layer take e4m3 weights and their scales from the checkpoint."""
    for m in net.modules():
        if isinstance(m, LinearBase):
            m.expect_fp8_checkpoint()


def skip_checkpoint_tensor(name: str, plan: Optional[QuantizationPlan]) -> bool:
    """Checkpoint tensors an FP8 checkpoint has that tokenmill does not use (static input scales)."""
    return plan is not None and plan.from_checkpoint and name.endswith(".input_scale")


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
