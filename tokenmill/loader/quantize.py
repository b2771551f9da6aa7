"""Quantization at load: which method a model gets (the engine's option, a checkpoint's
`quantization_config`), and quantizing its linear layers.

Block-wise FP8 checkpoints (HF's fine-grained FP8: `quant_method` "fp8" with `weight_block_size`
[128, 128], as Qwen3-FP8 and DeepSeek-V3 ship) store e4m3 weights [N, K] and `weight_scale_inv`
[ceil(N / 128), ceil(K / 128)], one scale per 128x128 block that multiplies: W[n, k] =
weight[n, k] * weight_scale_inv[n // 128, k // 128]. tokenmill's kernels read one scale per output
row, so these checkpoints are converted at load, once every tensor is in: the block scales are
loaded as stored (through the layers' weight loaders, split like the weight's rows and, for
row-parallel layers, columns), then each layer's rows are requantized to their largest block scale
(convert_block_fp8; quantization/fp8.py's requantize_blockwise_fp8). That costs one more e4m3
rounding of the elements whose block scale is not their row's largest (within 1/16 of the element,
or 2^-10 of the row's scale near zero); rows whose block scales are all equal convert exactly.
tests/quantization/test_fp8_blockwise.py measures it.

Mixture-of-experts checkpoints (Qwen3-30B-A3B-FP8) store their experts the same way, per expert
(layers/fp8_moe.py), and keep each layer's router (`model.layers.<i>.mlp.gate`) in full precision,
listed in `modules_to_not_convert` with the norms: those routers keep their unquantized method.
"""

import contextlib
import re
from dataclasses import dataclass
from typing import Optional

import torch

from tokenmill.errors import ModelLoadError
from tokenmill.layers.fp8_linear import Fp8Config
from tokenmill.layers.fp8_moe import Fp8MoEMethod
from tokenmill.layers.fused_moe import FusedMoE, moe_quantization
from tokenmill.layers.linear import LinearBase, process_weights_after_loading, set_quantization
from tokenmill.logger import init_logger
from tokenmill.quantization import QUANTIZATION_METHODS

logger = init_logger(__name__)


@dataclass(frozen=True)
class QuantizationPlan:
    method: str  # "fp8"
    from_checkpoint: bool  # the checkpoint stores FP8 weights and scales (else: quantized after loading)
    block_size: Optional[tuple[int, int]] = None  # the checkpoint's scales are per block (converted at load)
    unquantized: tuple[str, ...] = ()  # MoE routers the checkpoint keeps in full precision (module names)


# the block size of block-wise FP8 checkpoints that tokenmill loads
SUPPORTED_BLOCK_SIZE = (128, 128)


# compressed-tensors "ignore" entries that name the LM head (which tokenmill never quantizes)
_LM_HEAD = ("lm_head", "re:.*lm_head", "re:lm_head")
# modules_to_not_convert entries that are no linear layer (tokenmill never quantizes the norms)
_NORM = re.compile(r".*norm")
# a mixture-of-experts layer's router, which FP8 MoE checkpoints leave in full precision
_ROUTER = re.compile(r"model\.layers\.\d+\.mlp\.gate")


def resolve_quantization(requested: Optional[str], hf_config: dict) -> Optional[QuantizationPlan]:
    """What to do about quantization (None: nothing). An FP8 checkpoint is read as stored:
    `quant_method` fp8 with per-tensor scales, or compressed-tensors float-quantized 8-bit weights
    with per-channel or per-tensor scales (static input scales are not used: activations are
    quantized per token at run time). `quant_method` fp8 with 128x128 block scales
    (`weight_block_size`) is loaded and converted to per-row scales (module docstring). Any other
    quantized checkpoint is refused with a message naming what it is."""
    checkpoint = hf_config.get("quantization_config")
    if checkpoint is None:
        if requested is None:
            return None
        if requested not in QUANTIZATION_METHODS:
            raise ModelLoadError(f"quantization method {requested!r} is not supported "
                                 f"(supported: {', '.join(QUANTIZATION_METHODS)})")
        return QuantizationPlan(requested, False)
    method = checkpoint.get("quant_method") if isinstance(checkpoint, dict) else None
    if method == "mxfp4" and "GptOssForCausalLM" in (hf_config.get("architectures") or []):
        # gpt-oss's MXFP4 experts are dequantized at load (models/gpt_oss.py): a full-precision model
        if requested is not None:
            raise ModelLoadError(f"quantization {requested!r} was asked for, but gpt-oss's MXFP4 experts are "
                                 "dequantized at load and served in the model dtype; leave quantization unset")
        return None
    block_size, routers = None, ()
    if method == "fp8":
        block_size, routers = _check_fp8(checkpoint)
    elif method == "compressed-tensors":
        _check_compressed_tensors(checkpoint)
    else:
        raise ModelLoadError(f"the checkpoint is quantized with quant_method {method!r}, which tokenmill does not "
                             f"load (it loads fp8 and compressed-tensors FP8 checkpoints, and full-precision ones)")
    if requested not in (None, "fp8"):
        raise ModelLoadError(f"quantization {requested!r} was asked for, but the checkpoint is already FP8")
    return QuantizationPlan("fp8", True, block_size, routers)


def _check_fp8(cfg: dict) -> tuple[Optional[tuple[int, int]], tuple[str, ...]]:
    """HF's `quant_method` fp8 config (FineGrainedFP8Config's fields); returns the block size (None:
    per-tensor scales) and the MoE routers left in full precision."""
    fmt = cfg.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelLoadError(f"FP8 checkpoint with fmt {fmt!r}: only e4m3 weights are supported")
    scheme = cfg.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ModelLoadError(f"FP8 checkpoint with activation_scheme {scheme!r} (dynamic or static are supported)")
    # "ignored_layers" is an alias some checkpoints use (HF reads it as modules_to_not_convert)
    skipped = cfg.get("modules_to_not_convert") or cfg.get("ignored_layers") or []
    routers = tuple(m for m in skipped if _ROUTER.fullmatch(m))
    unquantized = [m for m in skipped if m not in _LM_HEAD and m not in routers and not _NORM.fullmatch(m)]
    if unquantized:
        raise ModelLoadError(f"FP8 checkpoint with modules_to_not_convert {unquantized[:3]}: layers left unquantized "
                             f"other than the LM head and MoE routers are not supported")
    if cfg.get("modules_to_convert"):
        raise ModelLoadError(f"FP8 checkpoint with modules_to_convert {cfg['modules_to_convert'][:3]}: quantized "
                             f"modules other than the linear layers (e.g. embeddings) are not supported")
    block = cfg.get("weight_block_size")
    if not block:
        return None, routers
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or tuple(b if isinstance(b, int) else None for b in block) != SUPPORTED_BLOCK_SIZE):
        raise ModelLoadError(f"FP8 checkpoint with weight_block_size {block}: only "
                             f"{list(SUPPORTED_BLOCK_SIZE)} blocks are supported")
    scale_fmt = cfg.get("scale_fmt", "float")
    if scale_fmt not in ("float", "ue8m0"):
        raise ModelLoadError(f"FP8 checkpoint with scale_fmt {scale_fmt!r} (float or ue8m0 are supported)")
    return SUPPORTED_BLOCK_SIZE, routers


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


@contextlib.contextmanager
def expert_quantization(plan: Optional[QuantizationPlan], architecture: str):
    """Around the model's construction: the experts of a mixture-of-experts model take the plan's
    method (layers/fp8_moe.py) as they are built, so that no expert stack is allocated in the model
    dtype first, or the plan's config refuses the model (an FP8 checkpoint of experts with
    per-tensor or per-channel scales), naming the architecture."""
    if plan is None:
        yield
        return
    try:
        with moe_quantization(Fp8Config(from_checkpoint=plan.from_checkpoint, block_size=plan.block_size)):
            yield
    except ModelLoadError as e:
        raise ModelLoadError(f"{architecture}: {e}") from None


def log_expert_quantization(net: torch.nn.Module, plan: Optional[QuantizationPlan]) -> None:
    count = sum(isinstance(m, FusedMoE) and isinstance(m.moe_method, Fp8MoEMethod) for m in net.modules())
    if count:
        logger.info("fp8: the experts of %d mixture-of-experts layers are e4m3 (%s)", count,
                    "quantized as they load" if not plan.from_checkpoint else "from the checkpoint")


def expect_fp8_checkpoint(net: torch.nn.Module, block_size: Optional[tuple[int, int]] = None,
                          unquantized: tuple[str, ...] = ()) -> None:
    """Make every linear layer take e4m3 weights and their scales from the checkpoint (block_size:
    one scale per block, `weight_scale_inv`; convert_block_fp8_checkpoint after loading), except
    the modules named in `unquantized` (MoE routers; a name of no layer here, as a dense model's,
    or another pipeline stage's layer, leaves nothing to do)."""
    config = Fp8Config(from_checkpoint=True, block_size=block_size)
    keep = set(unquantized)
    for name, m in net.named_modules():
        if isinstance(m, LinearBase) and name not in keep:
            m.set_linear_method(config.get_linear_method(m))


@torch.no_grad()
def convert_block_fp8_checkpoint(net: torch.nn.Module) -> int:
    """Once every tensor of a block-wise FP8 checkpoint is loaded: every linear layer's weight is
    requantized from its block scales to per-row scales (module docstring); returns how many."""
    converted = 0
    for name, m in net.named_modules():
        if isinstance(m, LinearBase):
            if "weight_scale_inv" not in m._parameters:
                continue
            try:
                m.linear_method.process_weights_after_loading(m)
                converted += 1
            except ValueError as e:
                raise ModelLoadError(f"block-wise FP8 checkpoint, {name}: {e}") from None
    logger.info("fp8: %d linear layers converted from block-wise to per-row scales", converted)
    return converted


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
    set_quantization(net, Fp8Config())  # the layers keep their loaded weights until processed
    process_weights_after_loading(net)
    after = sum(m.weight.numel() * m.weight.element_size() + m.weight_scale.numel() * 4 for m in layers)
    logger.info("fp8: %d linear layers quantized, %.2f GB -> %.2f GB", len(layers), before / 1e9, after / 1e9)
    return len(layers)
