"""The experts of a mixture-of-experts MLP as one layer, split across tensor-parallel ranks, and the
methods that hold and run their weights.

`FusedMoE` stacks every expert this rank holds: `w13_weight` [E_local, 2 * I_local, H] (each
expert's gate rows, then its up rows) and `w2_weight` [E_local, H, I_local]. Under tensor
parallelism each expert's intermediate dimension is split over the ranks (gate/up by rows, down by
columns, as the dense MLP's column- and row-parallel layers split theirs), and the layer's output is
summed over the ranks, as RowParallelLinear's is. Under expert parallelism (`enable_expert_parallel`)
each rank holds whole experts, a contiguous share of them: `expert_map` maps a global expert id to
this rank's index or -1 (another rank's expert, which the kernel skips), and layers/moe_dispatch.py
brings the tokens to the experts and the results back.

gpt-oss's experts add `w13_bias` [E_local, 2 * I_local] (gate then up, split as w13's rows) and
`w2_bias` [E_local, H] (held by shard rank 0 only, zeros elsewhere, so that the tensor-parallel sum
adds it once) and take the clamped SwiGLU (`activation`); only the unquantized method runs them.

As linear layers do, the layer holds one method object chosen when the model is built or loaded
(`UnquantizedFusedMoEMethod`, `BatchInvariantFusedMoEMethod`; a quantization config's
`get_moe_method`): it creates the weights, converts them once loaded, and routes and runs the
experts (`apply`). Routing and the experts' MLPs
are kernels/fused_moe.py's.
"""

import contextlib
import contextvars
import re
from abc import abstractmethod
from typing import Optional

import torch
from torch import nn

from tokenmill.distributed import divide, get_tp_state
from tokenmill.errors import ModelLoadError
from tokenmill.kernels.batch_invariant import fused_moe_invariant
from tokenmill.kernels.fused_moe import ClampedSwiGLU, GroupedTopK, fused_moe, moe_route
from tokenmill.layers.linear import new_parameter
from tokenmill.layers.moe_dispatch import MoEDispatch, expert_range
from tokenmill.quantization.base import QuantizationConfig, QuantizeMethodBase

# A per-expert shard id: "<global expert id>.<gate|up|down>"; the fused 3D layout's whole tensors
# are "gate_up" ([E, 2I, H]) and "down" ([E, H, I]).
_EXPERT_SHARD = re.compile(r"(\d+)\.(gate|up|down)")
# The quantization config whose MoE method layers built now take from the start (loader/load.py:
# an FP8 model's experts are then never allocated in the model dtype first).
_BUILDING_CONFIG: contextvars.ContextVar[Optional[QuantizationConfig]] = contextvars.ContextVar(
    "tokenmill_moe_quantization", default=None)


@contextlib.contextmanager
def moe_quantization(config: QuantizationConfig):
    """FusedMoE layers built inside take config.get_moe_method (which may refuse the model)."""
    token = _BUILDING_CONFIG.set(config)
    try:
        yield
    finally:
        _BUILDING_CONFIG.reset(token)


class FusedMoEMethodBase(QuantizeMethodBase):
    """A FusedMoE layer's method: the experts' weights' form, and routing plus the experts' MLPs."""

    @abstractmethod
    def apply(self, layer: "FusedMoE", x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, H], router_logits [T, E] -> this rank's part of the experts' output [T, H] (before
        the tensor-parallel sum)."""


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    """Expert weights in the model dtype."""

    experts = staticmethod(fused_moe)  # (x, w13, w2, weights, ids, ...) -> the experts' output

    def create_weights(self, layer: "FusedMoE", dtype: torch.dtype, device: torch.device) -> None:
        e, i, h = layer.num_local_experts, layer.intermediate_size_per_rank, layer.hidden_size
        layer.w13_weight = new_parameter(layer, (e, 2 * i, h), dtype, device)
        layer.w2_weight = new_parameter(layer, (e, h, i), dtype, device)
        if layer.has_bias:
            layer.w13_bias = new_parameter(layer, (e, 2 * i), dtype, device, loader=FusedMoE.bias_loader)
            layer.w2_bias = new_parameter(layer, (e, h), dtype, device, loader=FusedMoE.bias_loader)

    def apply(self, layer: "FusedMoE", x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = layer.route(router_logits)
        if layer.expert_map is not None:  # other ranks' experts become -1, which the kernel skips
            ids = layer.expert_map[ids.long()]
        bias = dict(w13_bias=layer.w13_bias, w2_bias=layer.w2_bias) if layer.has_bias else {}
        return self.experts(x, layer.w13_weight, layer.w2_weight, weights, ids, activation=layer.activation, **bias)


class BatchInvariantFusedMoEMethod(UnquantizedFusedMoEMethod):
    """Unquantized experts whose every token's result is independent of the batch (batch_invariant;
    layers/invariance.py swaps it in)."""

    experts = staticmethod(fused_moe_invariant)


class FusedMoE(nn.Module):
    """The routed experts of one MoE block: top-k routing over `router_logits`, then the chosen
    experts' SiLU MLPs weighted and summed (the module docstring has the layout)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 dtype=None, device=None, method: Optional[FusedMoEMethodBase] = None, bias: bool = False,
                 activation: Optional[ClampedSwiGLU] = None, grouping: Optional[GroupedTopK] = None,
                 correction_bias: bool = False):
        """bias / activation: gpt-oss's expert biases and clamped SwiGLU (None: silu(gate) * up);
        grouping: DeepSeek's grouped / sigmoid routing (None: softmax top-k); correction_bias: an
        fp32 `e_score_correction_bias` [E] parameter added to the scores for the choice only (V3)."""
        super().__init__()
        self.has_bias = bias
        self.activation = activation
        self.grouping = grouping
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(num_experts, dtype=torch.float32, device=device),
                                                     requires_grad=False) if correction_bias else None)
        self.tp = get_tp_state()
        self.tp_rank, self.tp_size = self.tp.tp_rank, self.tp.tp_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        ep_size = self.tp.ep_size
        if ep_size > num_experts:
            raise ValueError(f"expert parallelism over {ep_size} ranks needs at least as many experts, the "
                             f"model has {num_experts}")
        # Expert parallelism: whole experts per rank, and expert_map [E] int32 holds a global expert's
        # index here or -1 (another rank's: the kernel skips it). Else every rank holds a slice of
        # every expert's intermediate dimension (split rank shard_rank of shard_count).
        self.shard_rank, shard_count = (0, 1) if ep_size > 1 else (self.tp_rank, self.tp_size)
        self.intermediate_size_per_rank = divide(intermediate_size, shard_count)
        start, end = expert_range(num_experts, ep_size, self.tp.ep_rank) if ep_size > 1 else (0, num_experts)
        self.local_expert_ids: list[int] = list(range(start, end))
        expert_map = None
        if ep_size > 1:
            expert_map = torch.full((num_experts,), -1, dtype=torch.int32, device=device)
            expert_map[start:end] = torch.arange(end - start, dtype=torch.int32, device=device)
        self.register_buffer("expert_map", expert_map, persistent=False)
        self.dispatch = MoEDispatch(self.tp)
        self.params_dtype = dtype if dtype is not None else torch.get_default_dtype()
        config = _BUILDING_CONFIG.get()
        if method is None and config is not None:
            method = config.get_moe_method(self)
        self.moe_method = method or UnquantizedFusedMoEMethod()
        self._check_method(self.moe_method)
        self.moe_method.create_weights(self, self.params_dtype, device)

    def _check_method(self, method: FusedMoEMethodBase) -> None:
        if (self.has_bias or self.activation is not None) and not isinstance(method, UnquantizedFusedMoEMethod):
            raise ModelLoadError(f"{type(method).__name__}: experts with biases or the clamped SwiGLU (gpt-oss) run "
                             "unquantized only")

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], global expert ids [T, k] int32) of every token: the routing step of each method."""
        return moe_route(router_logits, self.top_k, self.renormalize, self.grouping, self.e_score_correction_bias)

    @property
    def num_local_experts(self) -> int:
        return len(self.local_expert_ids)

    def set_moe_method(self, method: FusedMoEMethodBase) -> None:
        """Give the layer another method before its weights are loaded (it creates the weights it loads)."""
        self._check_method(method)
        self.moe_method = method
        method.create_weights(self, self.params_dtype, self.w13_weight.device)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, H] (the same on every tensor-parallel rank), router_logits [T, E] -> the experts'
        output [T, H], summed over the ranks (layers/moe_dispatch.py)."""
        return self.dispatch(x, router_logits, lambda xs, logits: self.moe_method.apply(self, xs, logits))

    # ---- loading: checkpoint tensors into the stacked weights ----
    def _local_index(self, expert: int) -> Optional[int]:
        """This rank's index of a global expert id (None: another rank's expert)."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range: the layer has {self.num_experts} experts")
        if self.expert_map is None:
            return expert
        local = int(self.expert_map[expert])
        return None if local < 0 else local

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        """Copy this rank's part of a checkpoint tensor into its place: one expert's `gate`, `up`
        ([I, H]) or `down` ([H, I]) projection (shard "<expert>.<proj>"), or every expert's at once
        in transformers' fused layout (shard "gate_up": [E, 2I, H], "down": [E, H, I])."""
        full_i, h = self.intermediate_size, self.hidden_size
        if shard_id in ("gate_up", "down"):
            shape = (self.num_experts, 2 * full_i, h) if shard_id == "gate_up" else (self.num_experts, h, full_i)
            _check_shape(loaded, shape, f"experts' {shard_id}_proj")
            for expert in range(self.num_experts):
                if shard_id == "down":
                    self._load_one(param, loaded[expert], expert, "down")
                else:
                    self._load_one(param, loaded[expert, :full_i], expert, "gate")
                    self._load_one(param, loaded[expert, full_i:], expert, "up")
            return
        match = _EXPERT_SHARD.fullmatch(str(shard_id))
        if match is None:
            raise ValueError(f"unknown expert shard {shard_id!r}")
        self._load_one(param, loaded, int(match.group(1)), match.group(2))

    def _load_one(self, param: nn.Parameter, loaded: torch.Tensor, expert: int, proj: str) -> None:
        local = self._local_index(expert)
        if local is None:
            return  # another rank's expert
        i, full_i, h = self.intermediate_size_per_rank, self.intermediate_size, self.hidden_size
        what = f"expert {expert} {proj}_proj"
        if proj == "down":
            _check_shape(loaded, (h, full_i), what)
            param.data[local].copy_(loaded.narrow(1, self.shard_rank * i, i))
            return
        _check_shape(loaded, (full_i, h), what)
        offset = 0 if proj == "gate" else i
        param.data[local].narrow(0, offset, i).copy_(loaded.narrow(0, self.shard_rank * i, i))

    def bias_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Every expert's gate/up bias [E, 2I] (gate then up) into w13_bias, or down bias [E, H] into
        w2_bias: this rank's experts, its slice of I; the down bias on shard rank 0 only."""
        local = [e for e in range(self.num_experts) if self._local_index(e) is not None]
        full_i, i = self.intermediate_size, self.intermediate_size_per_rank
        if param is self.w2_bias:
            _check_shape(loaded, (self.num_experts, self.hidden_size), "experts' down_proj bias")
            if self.shard_rank == 0:
                param.data.copy_(loaded[local])
            else:  # the tensor-parallel sum adds rank 0's
                param.data.zero_()
            return
        _check_shape(loaded, (self.num_experts, 2 * full_i), "experts' gate_up_proj bias")
        rows = loaded[local]
        param.data[:, :i].copy_(rows[:, self.shard_rank * i:(self.shard_rank + 1) * i])
        param.data[:, i:].copy_(rows[:, full_i + self.shard_rank * i:full_i + (self.shard_rank + 1) * i])

    def expected_shards(self, param_name: str) -> list[str]:
        """The shard ids a complete checkpoint loads into `w13_weight` or `w2_weight` (or their
        `*_scale_inv`; per expert: the fused layout's whole tensors count as every expert's)."""
        projs = ("down",) if param_name.startswith("w2_") else ("gate", "up")
        return [f"{e}.{p}" for e in self.local_expert_ids for p in projs]

    def shards_covered(self, param_name: str, shard_id: str) -> list[str]:
        """The expected_shards that loading `shard_id` into `param_name` fills (a fused tensor: all)."""
        return self.expected_shards(param_name) if shard_id in ("gate_up", "down") else [shard_id]

    def extra_repr(self) -> str:
        return (f"experts={self.num_local_experts}/{self.num_experts}, top_k={self.top_k}, "
                f"hidden={self.hidden_size}, intermediate={self.intermediate_size_per_rank} per rank, "
                f"renormalize={self.renormalize}, method={type(self.moe_method).__name__}")


def _check_shape(loaded: torch.Tensor, expected: tuple, what: str) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"shape mismatch loading {what}: checkpoint {tuple(loaded.shape)}, model {tuple(expected)}")


def set_moe_quantization(net: nn.Module, config: QuantizationConfig) -> int:
    """Give every FusedMoE layer of net the config's MoE method (before loading); the config refuses
    the model if it cannot quantize experts. Returns how many layers took a method."""
    count = 0
    for m in net.modules():
        if isinstance(m, FusedMoE):
            method = config.get_moe_method(m)
            if method is not None:
                m.set_moe_method(method)
                count += 1
    return count


@torch.no_grad()
def process_moe_weights_after_loading(net: nn.Module) -> None:
    """Every FusedMoE layer's method converts its loaded weights (a no-op for unquantized experts)."""
    for m in net.modules():
        if isinstance(m, FusedMoE):
            m.moe_method.process_weights_after_loading(m)
