"""Batch-invariant numerics chosen per model (EngineConfig.batch_invariant): the linear layers take
BatchInvariantLinearMethod, the experts BatchInvariantFusedMoEMethod, and attention and the LM head
their batch-invariant kernels (kernels/batch_invariant.py). The choice lives on the layers, so the
step path reads no mode, and two engines in one process (one batch-invariant) never change each
other's kernels.
"""

import copy
import itertools

from torch import nn

from tokenmill.layers.attention import Attention
from tokenmill.layers.embedding import ParallelLMHead
from tokenmill.layers.fused_moe import BatchInvariantFusedMoEMethod, FusedMoE, UnquantizedFusedMoEMethod
from tokenmill.layers.linear import (BatchInvariantLinearMethod, LinearBase, RowParallelLinear,
                                    UnquantizedLinearMethod)
from tokenmill.layers.norm import ShardedRMSNorm


def is_batch_invariant_model(model: nn.Module) -> bool:
    return any(isinstance(m, Attention) and m.batch_invariant for m in model.modules())


def with_batch_invariance(model: nn.Module, enabled: bool) -> nn.Module:
    """The model with batch-invariant layers (enabled) or the default ones: the model itself when
    its layers already are so, else a copy of its modules that shares every parameter and buffer (and
    the tensor-parallel state)
    (an engine's runner takes it, so other engines over the same loaded model keep theirs)."""
    if is_batch_invariant_model(model) == enabled:
        return model
    shared = itertools.chain(model.parameters(), model.buffers(),
                             (m.tp for m in model.modules() if getattr(m, "tp", None) is not None))
    view = copy.deepcopy(model, memo={id(t): t for t in shared})
    for m in view.modules():
        if isinstance(m, (RowParallelLinear, ShardedRMSNorm)):  # tensor parallelism's sums in rank order
            m.fixed_order_reduce = enabled
        if isinstance(m, LinearBase):
            if not isinstance(m.linear_method, UnquantizedLinearMethod):
                raise ValueError(f"batch-invariant numerics need unquantized linear layers, not "
                                 f"{type(m.linear_method).__name__}")
            m.linear_method = BatchInvariantLinearMethod() if enabled else UnquantizedLinearMethod()
        elif isinstance(m, FusedMoE):
            if not isinstance(m.moe_method, UnquantizedFusedMoEMethod):
                raise ValueError(f"batch-invariant numerics need unquantized experts, not "
                                 f"{type(m.moe_method).__name__}")
            m.moe_method = BatchInvariantFusedMoEMethod() if enabled else UnquantizedFusedMoEMethod()
            m.dispatch.fixed_order_reduce = enabled
        elif isinstance(m, (Attention, ParallelLMHead)):
            m.batch_invariant = enabled
    return view
