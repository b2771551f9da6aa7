"""Linear layers split across tensor-parallel ranks, and the methods that hold and multiply their weights.

Each layer gets one method object when the model is built or loaded (`LinearBase.set_linear_method`):
`UnquantizedLinearMethod` (weights in the model dtype; one-token steps on CUDA take the fused GEMV,
the rest cuBLAS), `BatchInvariantLinearMethod` (layers/invariance.py swaps it in per model) and the
quantized ones (layers/fp8_linear.py). The layer keeps the geometry (how checkpoint tensors split
over ranks and q/k/v, gate/up shards) and the LoRA hook; the method decides the weights' form and
the kernels, so the step path reads no mode.

Each parameter carries a `weight_loader(param, loaded, shard_id=None)` that takes the full
checkpoint tensor and copies this rank's part of it into the right place, so fused layers (q/k/v,
gate/up) can be loaded from the checkpoint's separate tensors.
"""

import weakref
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed import divide, get_tp_size, get_tp_state, tp_all_reduce, tp_all_reduce_max
from tokenmill.kernels import qkv_rope_gemv, skinny_gemm
from tokenmill.kernels.activation import silu_and_mul
from tokenmill.kernels.batch_invariant import linear_invariant
from tokenmill.kernels.skinny_gemm import ADD_RMSNORM, PLAIN, SILU_MUL
from tokenmill.layers.forward_context import LoRAHook, current_forward_context
from tokenmill.quantization.base import QuantizationConfig, QuantizeMethodBase


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch loading {what}: checkpoint {tuple(src.shape)}, model {tuple(dst.shape)}")
    dst.copy_(src)


def _check_full_shape(loaded: torch.Tensor, expected: tuple, what: str) -> None:
    """The checkpoint tensor must have the unsplit shape the model expects (before taking this rank's part)."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"shape mismatch loading {what}: checkpoint {tuple(loaded.shape)}, model {tuple(expected)}")


class LayerLoader:
    """A parameter's weight_loader: fn(layer, param, loaded[, shard_id]) with the layer held weakly,
    since a bound method of the layer on its own parameter would be a reference cycle that keeps a
    deleted model alive until the garbage collector runs."""

    __slots__ = ("_layer", "_fn")

    def __init__(self, layer: nn.Module, fn: Callable):
        self._layer = weakref.ref(layer)
        self._fn = fn

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, *shard_id) -> None:
        layer = self._layer()
        if layer is None:
            raise RuntimeError("the layer that owns this parameter was freed")
        self._fn(layer, param, loaded, *shard_id)


def _layer_weight_loader(layer: "LinearBase", param: nn.Parameter, loaded: torch.Tensor, *shard_id) -> None:
    layer.weight_loader(param, loaded, *shard_id)  # the layer's own split (q/k/v, gate/up, ranks)


def new_parameter(layer: nn.Module, shape, dtype: torch.dtype, device, loader: Optional[Callable] = None,
                  fill: Optional[float] = None) -> nn.Parameter:
    """A frozen parameter whose weight_loader is `loader(layer, param, loaded[, shard_id])` (default:
    the layer's weight_loader), the layer held weakly."""
    data = torch.empty(shape, dtype=dtype, device=device) if fill is None else \
        torch.full(shape, fill, dtype=dtype, device=device)
    param = nn.Parameter(data, requires_grad=False)
    param.weight_loader = LayerLoader(layer, loader or _layer_weight_loader)
    return param


# The kernels take up to skinny_gemm.MAX_ROWS rows, but at 2 to 8 rows (verify steps, small decode
# batches) they lose to cuBLAS on the H200 (2026-12-01, kernel_bench --skinny-rows 1,2,4,8 at
# Llama-3.1-8B shapes: 26-69 % of copy bandwidth against cuBLAS's 72-96 %; a decoder layer at 4 rows
# 0.173 ms at the best config against 0.118 ms unfused), so only one-row steps take them.
FUSED_MAX_ROWS = 1


class LinearMethodBase(QuantizeMethodBase):
    """A linear layer's method: the weights' form and the kernels of forward_fused (the layer's op
    before it, the product, the LoRA term)."""

    def takes_gemv(self, layer: "LinearBase", x: torch.Tensor) -> bool:
        """Whether x goes through the skinny GEMV with the op before the layer fused in."""
        return False

    def gemv_weight_scale(self, layer: "LinearBase") -> Optional[torch.Tensor]:
        """The per-row scales the GEMV kernels multiply by (None: weights in the model dtype)."""
        return None

    def forward_fused(self, layer: "LinearBase", x: torch.Tensor, prologue: int, residual: Optional[torch.Tensor],
                      norm: Optional[nn.Module], lora: Optional[LoRAHook]
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(layer's product of a(x) before the tensor-parallel reduction, the residual stream or None)."""
        if self.takes_gemv(layer, x):
            return gemv_forward(layer, x, prologue, residual, norm, lora, self.gemv_weight_scale(layer))
        return self.forward_unfused(layer, x, prologue, residual, norm, lora)

    def forward_unfused(self, layer: "LinearBase", x: torch.Tensor, prologue: int, residual: Optional[torch.Tensor],
                        norm: Optional[nn.Module], lora: Optional[LoRAHook]
                        ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The op before the layer as its own kernel, then apply(), then the LoRA term."""
        summed = None
        if prologue == SILU_MUL:
            x = silu_and_mul(x)
        elif prologue == ADD_RMSNORM:
            x = norm(x, residual)
            if residual is not None:
                x, summed = x
        y = self.apply(layer, x, layer.matmul_bias)
        if lora is not None:
            lora.apply(layer, x, PLAIN, None, y)
        return y, summed


def gemv_forward(layer: "LinearBase", x: torch.Tensor, prologue: int, residual: Optional[torch.Tensor],
                 norm: Optional[nn.Module], lora: Optional[LoRAHook], weight_scale: Optional[torch.Tensor]
                 ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """1 to FUSED_MAX_ROWS tokens through kernels/skinny_gemm.py, the op before the layer fused in.
    One token with adapters: the shrink first, its term added inside the GEMV (kernels/lora_epilogue.py);
    more tokens: the term after the product. Either way the adapters apply the layer's prologue."""
    in_kernel = lora is not None and x.shape[0] == 1
    term = lora.gemv_term(layer, x, prologue, norm, residual) if in_kernel else None
    y = skinny_gemm.skinny_linear_triton(x, layer.weight, prologue, residual, None if norm is None else norm.weight,
                                         1e-6 if norm is None else norm.eps, lora=term, weight_scale=weight_scale)
    summed = None
    if isinstance(y, tuple):
        y, summed = y
    if lora is not None and not in_kernel:
        lora.apply(layer, x if summed is None else summed, prologue, norm, y)
    return y, summed


def gemv_fits(layer: "LinearBase", x: torch.Tensor) -> bool:
    """Steps of 1 to FUSED_MAX_ROWS tokens on CUDA (batch-1 decode) can take the skinny GEMV, unless
    the step's engine turned that off (its forward context says)."""
    if not (x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= FUSED_MAX_ROWS and layer.bias is None
            and x.stride(-1) == 1):
        return False
    ctx = current_forward_context()
    return ctx is None or ctx.small_batch_fusion


class UnquantizedLinearMethod(LinearMethodBase):
    """Weights [N, K] in the model dtype: the skinny GEMV at one-token steps on CUDA, F.linear (cuBLAS) otherwise."""

    def create_weights(self, layer: "LinearBase", dtype: torch.dtype, device: torch.device) -> None:
        layer.weight = new_parameter(layer, (layer.out_features, layer.in_features), dtype, device)

    def takes_gemv(self, layer: "LinearBase", x: torch.Tensor) -> bool:
        return gemv_fits(layer, x)

    def apply(self, layer: "LinearBase", x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class BatchInvariantLinearMethod(UnquantizedLinearMethod):
    """The same weights through kernels/batch_invariant.py's matmul: one reduction order for every
    step shape; never the GEMV (it reduces in another order than larger steps)."""

    def takes_gemv(self, layer: "LinearBase", x: torch.Tensor) -> bool:
        return False

    def apply(self, layer: "LinearBase", x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return linear_invariant(x, layer.weight, bias)


class LinearBase(nn.Module):
    BIAS_AFTER_REDUCTION = False  # row-parallel layers add the bias after the all-reduce

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype=None, device=None,
                 linear_method: Optional[LinearMethodBase] = None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.params_dtype = dtype if dtype is not None else torch.get_default_dtype()
        self.linear_method = linear_method or UnquantizedLinearMethod()
        self.linear_method.create_weights(self, self.params_dtype, device)
        if bias:
            self.bias = new_parameter(self, (out_features,), self.params_dtype, device)
        else:
            self.register_parameter("bias", None)

    def set_linear_method(self, method: LinearMethodBase) -> None:
        """Give the layer another method before its weights are loaded (a quantized checkpoint's): the
        method creates the weights it loads. The bias stays."""
        self.linear_method = method
        method.create_weights(self, self.params_dtype, self.weight.device)

    @property
    def matmul_bias(self) -> Optional[torch.Tensor]:
        """The bias the product adds (a row-parallel layer adds its own after the reduction)."""
        return None if self.BIAS_AFTER_REDUCTION else self.bias

    # ---- geometry: how checkpoint tensors map onto this layer (weight loaders, quantized methods) ----
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _copy_checked(param.data, loaded, type(self).__name__)

    def _checkpoint_rows(self, shard_id) -> int:
        """Output rows of the checkpoint tensor (of one shard) that this layer's rows come from."""
        return self.out_features

    def _checkpoint_cols(self) -> int:
        """Input columns of the checkpoint tensor (all of them; a row-parallel layer holds a slice)."""
        return self.in_features

    def _col_offset(self) -> int:
        """Where this layer's columns start in the checkpoint tensor."""
        return 0

    def _load_row_vector(self, param: nn.Parameter, rows: torch.Tensor, shard_id) -> None:
        """A per-output-row tensor [rows, ...] (of one shard) goes where the weight's rows go."""
        self.weight_loader(param, rows, *(() if shard_id is None else (shard_id,)))

    def _whole_row_max(self, row_max: torch.Tensor) -> torch.Tensor:
        """Per output row, the max over every rank's slice of the row (a row-parallel layer's ranks
        each hold some columns); here the layer holds whole rows."""
        return row_max

    # ---- the forward pass ----
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_fused(x)

    def forward_fused(self, x: torch.Tensor, prologue: int = PLAIN, residual: Optional[torch.Tensor] = None,
                      norm: Optional[nn.Module] = None):
        """self(a(x)), where a is the op before this layer (skinny_gemm's PLAIN, SILU_MUL, or
        ADD_RMSNORM with the RMSNorm module `norm`); with ADD_RMSNORM and a residual, returns
        (y, x + residual) for the next layer's residual stream."""
        ctx = current_forward_context()
        lora = ctx.lora if ctx is not None else None
        y, summed = self.linear_method.forward_fused(self, x, prologue, residual, norm, lora)
        y = self._finish(y)
        return y if summed is None else (y, summed)

    def _finish(self, y: torch.Tensor) -> torch.Tensor:
        """What follows the product (the tensor-parallel reduction of row-parallel layers)."""
        return y


def set_quantization(net: nn.Module, config: QuantizationConfig) -> int:
    """Give every linear layer of net the config's method (before loading: each creates the weights
    it loads); returns how many layers took one."""
    count = 0
    for m in net.modules():
        if isinstance(m, LinearBase):
            method = config.get_linear_method(m)
            if method is not None:
                m.set_linear_method(method)
                count += 1
    return count


@torch.no_grad()
def process_weights_after_loading(net: nn.Module) -> None:
    """Every linear layer's method converts its loaded weights (block scales to row scales, online quantization)."""
    for m in net.modules():
        if isinstance(m, LinearBase):
            m.linear_method.process_weights_after_loading(m)


class ReplicatedLinear(LinearBase):
    """y = x W^T with the whole W on every rank (a mixture-of-experts router: every rank routes
    every token the same way)."""


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W split by output rows: each rank computes a slice of y."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=None, device=None,
                 linear_method: Optional[LinearMethodBase] = None):
        self.tp = get_tp_state()
        self.tp_rank, self.tp_size = self.tp.tp_rank, self.tp.tp_size
        super().__init__(in_features, divide(out_features, self.tp_size), bias, dtype, device, linear_method)

    def weight_loader(self, param, loaded, shard_id=None):
        rows = param.shape[0]
        _check_full_shape(loaded, (rows * self.tp_size, *param.shape[1:]), type(self).__name__)
        _copy_checked(param.data, loaded.narrow(0, self.tp_rank * rows, rows), type(self).__name__)

    def _checkpoint_rows(self, shard_id) -> int:
        return self.out_features * self.tp_size


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stored as one matrix (gate and up of the MLP)."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool = False, dtype=None, device=None,
                 linear_method: Optional[LinearMethodBase] = None):
        self.output_sizes = list(output_sizes)
        super().__init__(in_features, sum(output_sizes), bias, dtype, device, linear_method)

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
                 dtype=None, device=None, linear_method: Optional[LinearMethodBase] = None):
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp)
        # With more ranks than kv heads, kv heads are replicated.
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.kv_replicas = max(1, tp // num_kv_heads)
        total = (num_heads + 2 * self.num_kv_heads * tp) * head_dim
        super().__init__(hidden_size, total, bias, dtype, device, linear_method)

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
        return self.linear_method.takes_gemv(self, x) and qkv_rope_gemv.fusable(
            self.out_features, self.in_features, self.head_dim, x.dtype, tokens=x.shape[0])

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
                                                    weight_scale=self.linear_method.gemv_weight_scale(self),
                                                    kv_scale=kv_scale)


class RowParallelLinear(LinearBase):
    """y = x W^T with W split by input columns: each rank holds a partial sum, then all-reduce."""
    BIAS_AFTER_REDUCTION = True

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=None, device=None,
                 linear_method: Optional[LinearMethodBase] = None):
        self.tp = get_tp_state()
        self.tp_rank, self.tp_size = self.tp.tp_rank, self.tp.tp_size
        self.fixed_order_reduce = False  # batch_invariant: the ranks' partial sums added in rank order
        super().__init__(divide(in_features, self.tp_size), out_features, bias, dtype, device, linear_method)

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:  # the bias is not split
            _copy_checked(param.data, loaded, "bias")
            return
        cols = param.shape[1]
        _check_full_shape(loaded, (param.shape[0], cols * self.tp_size), type(self).__name__)
        _copy_checked(param.data, loaded.narrow(1, self.tp_rank * cols, cols), type(self).__name__)

    def _load_row_vector(self, param, rows, shard_id) -> None:
        _copy_checked(param.data, rows, "a per-row tensor")  # every rank has every output row

    def _checkpoint_cols(self) -> int:
        return self.in_features * self.tp_size

    def _col_offset(self) -> int:
        return self.tp_rank * self.in_features

    def _whole_row_max(self, row_max: torch.Tensor) -> torch.Tensor:
        """A max over the ranks' slices, so every rank quantizes (and converts) as one process does."""
        return tp_all_reduce_max(row_max.contiguous(), self.tp)

    def _finish(self, y: torch.Tensor) -> torch.Tensor:
        y = tp_all_reduce(y, self.tp, self.fixed_order_reduce)
        return y if self.bias is None else y + self.bias


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[object] = None) -> None:
    _copy_checked(param.data, loaded, "parameter")
