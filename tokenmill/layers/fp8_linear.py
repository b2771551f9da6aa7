"""FP8 (e4m3) linear layers: `Fp8Config` and its `Fp8LinearMethod` (the weights' forms and the
kernels are quantization/fp8.py's; its docstring tells which path a step takes).

Three sources of weights, one form at run time (e4m3 [N, K] and one fp32 scale per output row,
the `weight_scale` parameter):
- online (`Fp8Config()`): the model-dtype weights are loaded as usual and quantized per row once in
  (process_weights_after_loading);
- an FP8 checkpoint with per-channel or per-tensor scales (`from_checkpoint=True`): the weight is
  an e4m3 parameter and `weight_scale` [N] takes the scales, a per-tensor (or per q/k/v, gate/up
  shard) scale spread over the rows it covers;
- a block-wise checkpoint (`block_size=(bn, bk)`): `weight_scale_inv` [N, B] takes the block scales
  repeated over the rows of each block (so the layers' row splits apply to them as to the weight),
  then each row is requantized to its largest block scale (requantize_blockwise_fp8).
"""

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.kernels.skinny_gemm import ADD_RMSNORM, PLAIN, SILU_MUL
from tokenmill.layers.forward_context import LoRAHook, current_forward_context
from tokenmill.layers.fp8_moe import Fp8MoEMethod
from tokenmill.layers.linear import LinearBase, LinearMethodBase, gemv_fits, new_parameter
from tokenmill.quantization.base import QuantizationConfig
from tokenmill.quantization.fp8 import (FP8_DTYPE, dequantize_weight_fp8, fp8_linear, fp8_linear_after_norm,
                                        fp8_linear_after_silu_mul, fp8_one_row_takes_w8a8, quantize_weight_fp8,
                                        requantize_blockwise_fp8)


@dataclass(frozen=True)
class Fp8Config(QuantizationConfig):
    """FP8 weights with one scale per output row at run time (module docstring); the experts of
    mixture-of-experts layers take layers/fp8_moe.py's Fp8MoEMethod."""
    name: ClassVar[str] = "fp8"
    from_checkpoint: bool = False  # the checkpoint stores e4m3 weights and scales (else: quantized after loading)
    block_size: Optional[tuple[int, int]] = None  # the checkpoint's scales are per bn x bk block

    def get_linear_method(self, layer: nn.Module) -> "Fp8LinearMethod":
        return Fp8LinearMethod(self)

    def get_moe_method(self, layer: nn.Module) -> Fp8MoEMethod:
        if self.from_checkpoint and self.block_size is None:
            raise ModelLoadError("FP8 checkpoints of mixture-of-experts models with per-tensor or per-channel "
                                 "scales are not supported yet (block-wise ones and quantization=\"fp8\" are)")
        return Fp8MoEMethod(self)


class Fp8LinearMethod(LinearMethodBase):
    """e4m3 weights with per-row scales: the GEMV (weight-only) at one-token steps on CUDA, except
    the widest layers; W8A8 otherwise, with the norm or SiLU-and-mul before the layer writing the
    e4m3 rows itself where it can; the dequantized weight on the CPU."""

    def __init__(self, config: Fp8Config):
        self.config = config

    # ---- weights ----
    def create_weights(self, layer: LinearBase, dtype: torch.dtype, device: torch.device) -> None:
        cfg = self.config
        if not cfg.from_checkpoint:
            # Quantized from model-dtype weights once loaded; a layer given this method after
            # loading keeps the weights it holds.
            if getattr(layer, "weight", None) is None:
                layer.weight = new_parameter(layer, (layer.out_features, layer.in_features), dtype, device)
            return
        layer.weight = new_parameter(layer, (layer.out_features, layer.in_features), FP8_DTYPE, device,
                                     self._load_weight)
        if cfg.block_size is not None:
            _, count = self.scale_block_cols(layer)
            layer.register_parameter("weight_scale_inv", new_parameter(
                layer, (layer.out_features, count), torch.float32, device, self._load_block_scales, fill=1.0))
            return
        layer.register_parameter("weight_scale", new_parameter(layer, (layer.out_features,), torch.float32, device,
                                                               self._load_scales, fill=1.0))

    @staticmethod
    def _what(layer: LinearBase, shard_id: tuple) -> str:
        return type(layer).__name__ if not shard_id else f"{type(layer).__name__} shard {shard_id[0]}"

    def _load_weight(self, layer: LinearBase, param: nn.Parameter, loaded: torch.Tensor, *shard_id) -> None:
        """An FP8 checkpoint's weight must be e4m3 (a wider one would be rounded to e4m3 without a scale)."""
        if loaded.dtype != FP8_DTYPE:
            raise ValueError(f"{self._what(layer, shard_id)}: the FP8 checkpoint stores this weight as {loaded.dtype}, "
                             f"not float8_e4m3fn (layers left unquantized are not supported)")
        layer.weight_loader(param, loaded, *shard_id)

    def _load_scales(self, layer: LinearBase, param: nn.Parameter, loaded: torch.Tensor, *shard_id) -> None:
        rows = loaded.float().reshape(-1)
        if rows.shape[0] == 1:  # one scale for the tensor (or the shard): every row of it
            rows = rows.expand(layer._checkpoint_rows(shard_id[0] if shard_id else None))
        layer._load_row_vector(param, rows.contiguous(), shard_id[0] if shard_id else None)

    def scale_block_cols(self, layer: LinearBase) -> tuple[int, int]:
        """(first, count): the column blocks of the checkpoint that this layer's columns fall in."""
        bk = self.config.block_size[1]
        start = layer._col_offset()
        first, last = start // bk, (start + layer.in_features - 1) // bk
        return first, last - first + 1

    def _load_block_scales(self, layer: LinearBase, param: nn.Parameter, loaded: torch.Tensor, *shard_id) -> None:
        """Block scales [ceil(rows / bn), ceil(cols / bk)] of a checkpoint tensor (of one shard):
        each block row repeated over its bn weight rows (the last block may be ragged), this
        layer's column blocks kept, then split over the rows as the weight is."""
        shard = shard_id[0] if shard_id else None
        bn, bk = self.config.block_size
        rows, cols = layer._checkpoint_rows(shard), layer._checkpoint_cols()
        want = (-(-rows // bn), -(-cols // bk))
        if tuple(loaded.shape) != want:
            raise ValueError(f"shape mismatch loading weight_scale_inv of {self._what(layer, shard_id)}: checkpoint "
                             f"{tuple(loaded.shape)}, expected {want} (one scale per {bn}x{bk} block of the "
                             f"{rows}x{cols} weight)")
        first, count = self.scale_block_cols(layer)
        per_row = loaded.float().repeat_interleave(bn, dim=0)[:rows, first:first + count]
        layer._load_row_vector(param, per_row.contiguous(), shard)

    @torch.no_grad()
    def process_weights_after_loading(self, layer: LinearBase) -> None:
        if not self.config.from_checkpoint:
            if layer.weight.dtype != FP8_DTYPE:
                w = layer.weight.data
                w_q, scale = quantize_weight_fp8(w, layer._whole_row_max(w.float().abs().amax(dim=1)))
                self._set_quantized(layer, w_q, scale)
            return
        inv = layer._parameters.get("weight_scale_inv")
        if inv is None:
            return
        blocks = inv.data
        if not bool(torch.isfinite(blocks).all()) or bool((blocks < 0).any()):
            raise ValueError(f"{type(layer).__name__}: the checkpoint's weight_scale_inv has negative or "
                             f"non-finite values")
        first, _ = self.scale_block_cols(layer)
        cols = torch.arange(layer._col_offset(), layer._col_offset() + layer.in_features, device=blocks.device)
        block_of_col = cols // self.config.block_size[1] - first
        w_q, scale = requantize_blockwise_fp8(layer.weight.data, blocks, block_of_col,
                                              layer._whole_row_max(blocks.amax(dim=1)))
        del layer.weight_scale_inv
        self._set_quantized(layer, w_q, scale)

    @staticmethod
    def _set_quantized(layer: LinearBase, w_q: torch.Tensor, scale: torch.Tensor) -> None:
        layer.weight = nn.Parameter(w_q, requires_grad=False)
        layer.__dict__.pop("_fp8_widened", None)
        layer.register_parameter("weight_scale", nn.Parameter(scale, requires_grad=False))

    # ---- the forward pass ----
    def takes_gemv(self, layer: LinearBase, x: torch.Tensor) -> bool:
        if not gemv_fits(layer, x):
            return False
        ctx = current_forward_context()
        # gate/up and wider: the W8A8 path (quantization/fp8.py), unless the step has adapters
        return (ctx is not None and ctx.lora is not None) or not fp8_one_row_takes_w8a8(x, layer.weight)

    def gemv_weight_scale(self, layer: LinearBase) -> Optional[torch.Tensor]:
        return layer.weight_scale

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if x.is_cuda:
            return fp8_linear(x, layer.weight, layer.weight_scale, bias)
        return F.linear(x, self._widened(layer, x.dtype), bias)

    @staticmethod
    def _widened(layer: LinearBase, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight off CUDA (the reference's values), widened once per layer and dtype
        rather than at every step: widening e4m3 is most of a CPU step's time."""
        cache = layer.__dict__.setdefault("_fp8_widened", {})
        if dtype not in cache:
            cache[dtype] = dequantize_weight_fp8(layer.weight, layer.weight_scale, dtype)
        return cache[dtype]

    def forward_unfused(self, layer: LinearBase, x: torch.Tensor, prologue: int, residual: Optional[torch.Tensor],
                        norm: Optional[nn.Module], lora: Optional[LoRAHook]
                        ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """After an RMSNorm or the SiLU-and-mul (no adapters): the op and the activation quantization
        in one launch where that applies; else the op, then the W8A8 product."""
        if lora is None and prologue != PLAIN:
            bias = layer.matmul_bias
            if prologue == SILU_MUL:
                y = fp8_linear_after_silu_mul(x, layer.weight, layer.weight_scale, bias)
                if y is not None:
                    return y, None
            elif prologue == ADD_RMSNORM:
                fused = fp8_linear_after_norm(x, layer.weight, layer.weight_scale, norm.weight, norm.eps, residual,
                                              bias)
                if fused is not None:
                    return fused if residual is not None else (fused[0], None)
        return super().forward_unfused(layer, x, prologue, residual, norm, lora)
