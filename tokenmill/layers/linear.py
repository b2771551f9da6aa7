"""Linear layers split across tensor-parallel ranks.

Each parameter carries a `weight_loader(param, loaded, shard_id=None)` that takes the full
checkpoint tensor and copies this rank's part of it into the right place, so fused layers (q/k/v,
gate/up) can be loaded from the checkpoint's separate tensors.
"""

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed import divide, get_tp_size, get_tp_state, tp_all_reduce, tp_all_reduce_max
from tokenmill.kernels import qkv_rope_gemv, skinny_gemm
from tokenmill.kernels.activation import silu_and_mul
from tokenmill.kernels.batch_invariant import linear_invariant
from tokenmill.kernels.skinny_gemm import ADD_RMSNORM, PLAIN, SILU_MUL
from tokenmill.layers.batch_invariant import is_batch_invariant
from tokenmill.layers.forward_context import current_forward_context
from tokenmill.quantization.fp8 import (FP8_DTYPE, fp8_linear, fp8_linear_after_norm, fp8_linear_after_silu_mul,
                                        fp8_one_row_takes_w8a8, quantize_weight_fp8, requantize_blockwise_fp8)

def _copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch loading {what}: checkpoint {tuple(src.shape)}, model {tuple(dst.shape)}")
    dst.copy_(src)


def _check_full_shape(loaded: torch.Tensor, expected: tuple, what: str) -> None:
    """The checkpoint tensor must have the unsplit shape the model expects (before taking this rank's part)."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"shape mismatch loading {what}: checkpoint {tuple(loaded.shape)}, model {tuple(expected)}")


# The kernels take up to skinny_gemm.MAX_ROWS rows, but at 2 to 8 rows (verify steps, small decode
# batches) they lose to cuBLAS on the H200 (2026-12-01, kernel_bench --skinny-rows 1,2,4,8 at
# Llama-3.1-8B shapes: 26-69 % of copy bandwidth against cuBLAS's 72-96 %; a decoder layer at 4 rows
# 0.173 ms at the best config against 0.118 ms unfused), so only one-row steps take them.
FUSED_MAX_ROWS = 1


class LinearBase(nn.Module):
    BIAS_AFTER_REDUCTION = False  # row-parallel layers add the bias after the all-reduce

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype=None, device=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.weight_scale: Optional[torch.Tensor] = None  # FP8 weights: per output row (quantize_fp8)

    def quantize_fp8(self) -> None:
        """Replace the loaded weight by its FP8 (e4m3) form and per-row scales (quantization/fp8.py)."""
        w_q, scale = quantize_weight_fp8(self.weight.data)
        self.weight = nn.Parameter(w_q, requires_grad=False)
        self.weight_scale = scale

    def expect_fp8_checkpoint(self, block_size: Optional[tuple[int, int]] = None) -> None:
        """Before loading an FP8 checkpoint: the weight parameter holds e4m3 bytes as stored, and a
        `weight_scale` parameter [N] takes the checkpoint's scales, per output row or one per
        tensor (or per q/k/v, gate/up shard), each written to the rows it covers.

        block_size (bn, bk): the checkpoint has one scale per bn x bk block instead
        (`weight_scale_inv` [ceil(N / bn), ceil(K / bk)], which multiplies). A parameter
        `weight_scale_inv` [N, B] takes them, repeated over the rows of each block so that the
        weight loader's row split (q/k/v, gate/up, tensor-parallel shards, of any size) applies to
        them as to the weight; B is the number of column blocks this layer's columns touch (all of
        them, or a row-parallel shard's). convert_block_fp8 then turns them into `weight_scale`."""
        w = nn.Parameter(torch.empty(self.weight.shape, dtype=FP8_DTYPE, device=self.weight.device),
                         requires_grad=False)
        w.weight_loader = self._fp8_weight_loader
        self.weight = w
        if block_size is not None:
            self.fp8_block_size = (int(block_size[0]), int(block_size[1]))
            first, count = self._scale_block_cols()
            inv = nn.Parameter(torch.ones(self.out_features, count, dtype=torch.float32, device=w.device),
                               requires_grad=False)
            inv.weight_loader = self.block_scale_loader
            self.register_parameter("weight_scale_inv", inv)  # weight_scale stays None until converted
            return
        scale = nn.Parameter(torch.ones(self.out_features, dtype=torch.float32, device=w.device), requires_grad=False)
        scale.weight_loader = self.scale_loader
        del self.weight_scale  # the plain attribute becomes the parameter the checkpoint fills
        self.register_parameter("weight_scale", scale)

    def _fp8_weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """An FP8 checkpoint's weight must be e4m3 (a wider one would be rounded to e4m3 without a scale)."""
        if param.dim() == 2 and loaded.dtype != FP8_DTYPE:
            what = type(self).__name__ if shard_id is None else f"{type(self).__name__} shard {shard_id}"
            raise ValueError(f"{what}: the FP8 checkpoint stores this weight as {loaded.dtype}, not float8_e4m3fn "
                             f"(layers left unquantized are not supported)")
        if shard_id is None:
            self.weight_loader(param, loaded)
        else:
            self.weight_loader(param, loaded, shard_id)

    def _checkpoint_cols(self) -> int:
        """Input columns of the checkpoint tensor (all of them; a row-parallel layer holds a slice)."""
        return self.in_features

    def _col_offset(self) -> int:
        """Where this layer's columns start in the checkpoint tensor."""
        return 0

    def _scale_block_cols(self) -> tuple[int, int]:
        """(first, count): the column blocks of the checkpoint that this layer's columns fall in."""
        bk = self.fp8_block_size[1]
        start = self._col_offset()
        first, last = start // bk, (start + self.in_features - 1) // bk
        return first, last - first + 1

    def block_scale_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Block scales [ceil(rows / bn), ceil(cols / bk)] of a checkpoint tensor (of one shard):
        each block row repeated over its bn weight rows (the last block may be ragged), this
        layer's column blocks kept, then split over the rows as the weight is."""
        bn, bk = self.fp8_block_size
        rows, cols = self._checkpoint_rows(shard_id), self._checkpoint_cols()
        want = (-(-rows // bn), -(-cols // bk))
        if tuple(loaded.shape) != want:
            what = type(self).__name__ if shard_id is None else f"{type(self).__name__} shard {shard_id}"
            raise ValueError(f"shape mismatch loading weight_scale_inv of {what}: checkpoint {tuple(loaded.shape)}, "
                             f"expected {want} (one scale per {bn}x{bk} block of the {rows}x{cols} weight)")
        first, count = self._scale_block_cols()
        per_row = loaded.float().repeat_interleave(bn, dim=0)[:rows, first:first + count]
        self._load_scale_rows(param, per_row.contiguous(), shard_id)

    def _row_scale_from_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """The converted per-row scales: each row's largest block scale."""
        return blocks.amax(dim=1)

    @torch.no_grad()
    def convert_block_fp8(self) -> bool:
        """After loading a block-wise FP8 checkpoint: the e4m3 weight and its block scales become an
        e4m3 weight with one scale per output row, the form the kernels read
        (quantization/fp8.py's requantize_blockwise_fp8). False if the layer has no block scales."""
        inv = self._parameters.get("weight_scale_inv")
        if inv is None:
            return False
        blocks = inv.data
        if not bool(torch.isfinite(blocks).all()) or bool((blocks < 0).any()):
            raise ValueError(f"{type(self).__name__}: the checkpoint's weight_scale_inv has negative or non-finite "
                             f"values")
        first, _ = self._scale_block_cols()
        cols = torch.arange(self._col_offset(), self._col_offset() + self.in_features, device=blocks.device)
        block_of_col = cols // self.fp8_block_size[1] - first
        w_q, scale = requantize_blockwise_fp8(self.weight.data, blocks, block_of_col,
                                              self._row_scale_from_blocks(blocks))
        self.weight = nn.Parameter(w_q, requires_grad=False)
        del self.weight_scale_inv
        del self.weight_scale  # the plain attribute (None) becomes a parameter, as for the other FP8 checkpoints
        self.register_parameter("weight_scale", nn.Parameter(scale, requires_grad=False))
        return True

    def scale_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        rows = loaded.float().reshape(-1)
        if rows.shape[0] == 1:  # one scale for the tensor (or the shard): every row of it
            rows = rows.expand(self._checkpoint_rows(shard_id))
        self._load_scale_rows(param, rows.contiguous(), shard_id)

    def _checkpoint_rows(self, shard_id) -> int:
        """Output rows of the checkpoint tensor (of one shard) that this layer's rows come from."""
        return self.out_features

    def _load_scale_rows(self, param: nn.Parameter, rows: torch.Tensor, shard_id) -> None:
        """Per-row scales [rows] go where the weight's rows go (the weight loader's split)."""
        self.weight_loader(param, rows, shard_id)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _copy_checked(param.data, loaded, type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_fused(x)

    def forward_fused(self, x: torch.Tensor, prologue: int = PLAIN, residual: Optional[torch.Tensor] = None,
                      norm: Optional[nn.Module] = None):
        """self(a(x)), where a is the op before this layer (skinny_gemm's PLAIN, SILU_MUL, or
        ADD_RMSNORM with the RMSNorm module `norm`); with ADD_RMSNORM and a residual, returns
        (y, x + residual) for the next layer's residual stream."""
        summed = None
        ctx = current_forward_context()
        lora = ctx.lora if ctx is not None else None
        if self._use_skinny(x):
            # One token with adapters: the shrink first, its term added inside the GEMV
            # (kernels/lora_epilogue.py); more tokens: the term after the product. Either way
            # the adapters apply the layer's prologue to its input.
            in_kernel = lora is not None and x.shape[0] == 1
            term = lora.gemv_term(self, x, prologue, norm, residual) if in_kernel else None
            y = skinny_gemm.skinny_linear_triton(x, self.weight, prologue, residual,
                                                 None if norm is None else norm.weight,
                                                 1e-6 if norm is None else norm.eps, lora=term,
                                                 weight_scale=self.weight_scale)
            if isinstance(y, tuple):
                y, summed = y
            if lora is not None and not in_kernel:
                lora.apply(self, x if summed is None else summed, prologue, norm, y)
        else:
            fused = self._fp8_after_prologue(x, prologue, residual, norm) if lora is None else None
            if fused is not None:
                y, summed = fused
            else:
                if prologue == SILU_MUL:
                    x = silu_and_mul(x)
                elif prologue == ADD_RMSNORM:
                    x = norm(x, residual)
                    if residual is not None:
                        x, summed = x
                y = self._matmul(x, self.bias)
                if lora is not None:
                    lora.apply(self, x, PLAIN, None, y)
        y = self._finish(y)
        return y if summed is None else (y, summed)

    def _use_skinny(self, x: torch.Tensor) -> bool:
        """Steps of 1 to FUSED_MAX_ROWS tokens on CUDA (batch-1 decode) take the skinny GEMV with the
        op before the layer fused in, unless the step's engine turned that off (its forward context
        says) or runs batch-invariant (the GEMV reduces in another order than larger steps)."""
        if not (x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= FUSED_MAX_ROWS and self.bias is None
                and x.stride(-1) == 1) or is_batch_invariant():
            return False
        ctx = current_forward_context()
        if self.weight_scale is not None and (ctx is None or ctx.lora is None) \
                and fp8_one_row_takes_w8a8(x, self.weight):
            return False  # FP8 gate/up: the W8A8 path (quantization/fp8.py)
        return ctx is None or ctx.small_batch_fusion

    def _fp8_after_prologue(self, x: torch.Tensor, prologue: int, residual: Optional[torch.Tensor],
                            norm: Optional[nn.Module]):
        """FP8 weights after an RMSNorm or the SiLU-and-mul: (y, the residual stream or None) with
        the op and the activation quantization in one launch (quantization/fp8.py), or None where
        that does not apply."""
        if self.weight_scale is None or prologue == PLAIN:
            return None
        bias = None if self.BIAS_AFTER_REDUCTION else self.bias
        if prologue == SILU_MUL:
            y = fp8_linear_after_silu_mul(x, self.weight, self.weight_scale, bias)
            return None if y is None else (y, None)
        fused = fp8_linear_after_norm(x, self.weight, self.weight_scale, norm.weight, norm.eps, residual, bias)
        if fused is None:
            return None
        return fused if residual is not None else (fused[0], None)

    def _matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.weight_scale is not None:
            return fp8_linear(x, self.weight, self.weight_scale, bias)
        if is_batch_invariant():
            return linear_invariant(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def _finish(self, y: torch.Tensor) -> torch.Tensor:
        """What follows the product (the tensor-parallel reduction of row-parallel layers)."""
        return y


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W split by output rows: each rank computes a slice of y."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=None, device=None):
        self.tp = get_tp_state()
        self.tp_rank, self.tp_size = self.tp.tp_rank, self.tp.tp_size
        super().__init__(in_features, divide(out_features, self.tp_size), bias, dtype, device)

    def weight_loader(self, param, loaded, shard_id=None):
        rows = param.shape[0]
        _check_full_shape(loaded, (rows * self.tp_size, *param.shape[1:]), type(self).__name__)
        _copy_checked(param.data, loaded.narrow(0, self.tp_rank * rows, rows), type(self).__name__)

    def _checkpoint_rows(self, shard_id) -> int:
        return self.out_features * self.tp_size


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stored as one matrix (gate and up of the MLP)."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool = False, dtype=None, device=None):
        self.output_sizes = list(output_sizes)
        super().__init__(in_features, sum(output_sizes), bias, dtype, device)

    def weight_loader(self, param, loaded, shard_id: int = 0):
        shard_rows = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        _check_full_shape(loaded, (self.output_sizes[shard_id], *param.shape[1:]), f"shard {shard_id}")
        part = loaded.narrow(0, self.tp_rank * shard_rows, shard_rows)
        _copy_checked(param.data.narrow(0, offset, shard_rows), part, f"shard {shard_id}")

    def _checkpoint_rows(self, shard_id) -> int:
        return self.output_sizes[shard_id or 0]


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; each rank holds its share of the query and kv heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 dtype=None, device=None):
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp)
        # With more ranks than kv heads, kv heads are replicated.
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.kv_replicas = max(1, tp // num_kv_heads)
        total = (num_heads + 2 * self.num_kv_heads * tp) * head_dim
        super().__init__(hidden_size, total, bias, dtype, device)

    def weight_loader(self, param, loaded, shard_id: str = "q"):
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, rank = 0, q_size, self.tp_rank
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, rank = kv_size, self.tp_rank // self.kv_replicas
        total_heads = self.num_heads * self.tp_size if shard_id == "q" else self.num_kv_heads * self.tp_size // self.kv_replicas
        _check_full_shape(loaded, (total_heads * self.head_dim, *param.shape[1:]), f"{shard_id}_proj")
        _copy_checked(param.data.narrow(0, offset, size), loaded.narrow(0, rank * size, size), f"{shard_id}_proj")

    def _checkpoint_rows(self, shard_id) -> int:
        if shard_id in (None, "q"):
            return self.num_heads * self.tp_size * self.head_dim
        return self.num_kv_heads * self.tp_size // self.kv_replicas * self.head_dim

    def fuses_rope(self, x: torch.Tensor) -> bool:
        """Whether x (1 to skinny_gemm.MAX_ROWS tokens) takes the GEMV that also does rotary and the
        KV-cache write (forward_rope_into_cache). Not while piecewise graphs are captured: there
        attention runs between the pieces (Attention.forward), after qkv_prep. In steps with
        LoRA adapters only at one token (the kernel's LoRA epilogue is the one-token kernel's)."""
        ctx = current_forward_context()
        if ctx is not None and (ctx.splitter is not None or (ctx.lora is not None and x.shape[0] != 1)):
            return False
        return self._use_skinny(x) and qkv_rope_gemv.fusable(self.out_features, self.in_features, self.head_dim,
                                                             x.dtype, tokens=x.shape[0])

    def forward_rope_into_cache(self, x: torch.Tensor, residual: Optional[torch.Tensor], norm: nn.Module,
                                positions: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                                v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                                kv_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """1 to MAX_ROWS tokens: q/k/v of norm(x + residual), with q and k rotated and k/v stored at
        each token's slot, in one kernel (kernels/qkv_rope_gemv.py). Returns (rotated q [T, Hq, D],
        the residual stream). In a step with adapters, the q/k/v LoRA term joins the projection
        before the rotation (the shrink runs first)."""
        ctx = current_forward_context()
        lora = ctx.lora if ctx is not None else None
        term = lora.gemv_term(self, x, ADD_RMSNORM, norm, residual) if lora is not None else None
        return qkv_rope_gemv.skinny_qkv_rope_triton(x, self.weight, residual, norm.weight, norm.eps, positions,
                                                    cos_sin_cache, slot_mapping, k_cache, v_cache,
                                                    self.num_heads, self.num_kv_heads, lora=term,
                                                    weight_scale=self.weight_scale, kv_scale=kv_scale)


class RowParallelLinear(LinearBase):
    """y = x W^T with W split by input columns: each rank holds a partial sum, then all-reduce."""
    BIAS_AFTER_REDUCTION = True

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=None, device=None):
        self.tp = get_tp_state()
        self.tp_rank, self.tp_size = self.tp.tp_rank, self.tp.tp_size
        super().__init__(divide(in_features, self.tp_size), out_features, bias, dtype, device)

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:  # the bias is not split
            _copy_checked(param.data, loaded, "bias")
            return
        cols = param.shape[1]
        _check_full_shape(loaded, (param.shape[0], cols * self.tp_size), type(self).__name__)
        _copy_checked(param.data, loaded.narrow(1, self.tp_rank * cols, cols), type(self).__name__)

    def _load_scale_rows(self, param, rows, shard_id) -> None:
        _copy_checked(param.data, rows, "weight_scale")  # every rank has every output row

    def _checkpoint_cols(self) -> int:
        return self.in_features * self.tp_size

    def _col_offset(self) -> int:
        return self.tp_rank * self.in_features

    def _row_scale_from_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """The largest block scale of each whole row (a max over the ranks' slices), so every rank
        converts as one process does."""
        return tp_all_reduce_max(blocks.amax(dim=1).contiguous(), self.tp)

    def quantize_fp8(self) -> None:
        """Each rank holds a slice of every row: the scales come from the whole rows' largest
        weights (a max over the ranks), so tensor parallelism quantizes exactly as one process."""
        amax = tp_all_reduce_max(self.weight.data.float().abs().amax(dim=1), self.tp)
        w_q, scale = quantize_weight_fp8(self.weight.data, amax)
        self.weight = nn.Parameter(w_q, requires_grad=False)
        self.weight_scale = scale

    def _matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return super()._matmul(x)  # the bias is added once, after the reduction

    def _finish(self, y: torch.Tensor) -> torch.Tensor:
        y = tp_all_reduce(y, self.tp)
        return y if self.bias is None else y + self.bias


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[object] = None) -> None:
    _copy_checked(param.data, loaded, "parameter")
