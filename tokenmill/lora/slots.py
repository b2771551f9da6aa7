"""Adapter weights in stacked device slots, and the per-step context the linear layers read.

For each LoRA-capable projection of the model (a decoder layer's fused q/k/v, o, fused gate/up and
down) there is one stack of A matrices [S, slices * R, K] and one of B matrices [S, N, R], where
S = max_loras + 1 and R = max_lora_rank. Slot 0 is all zeros and means "no adapter"; an adapter of
a lower rank fills its first r columns and leaves the rest zero, and a module the adapter does not
target stays zero. The fused projections keep their slices: q, k, v (or gate, up) each have R
columns of A and their own rows of B (kernels/lora.py's slice_starts).

Slots are given out least-recently-used: an adapter stays resident after its last request ends
until its slot is needed, and a slot in use by a running request is never taken (the scheduler
admits at most max_loras distinct adapters at once). Weights are written with copies on the
compute stream, so a step still reading a slot finishes before it is overwritten.

Each row of the persistent request state holds its slot (runner/lora_state.py). Per step the
runner expands them to one slot per token in a persistent device buffer (padding tokens: 0); CUDA
graphs captured with a LoRAStepContext read that buffer and the stacks at fixed addresses, so
switching adapters needs no recapture.
"""

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
from torch import nn

from tokenmill.kernels.lora import lora_expand, lora_shrink
from tokenmill.kernels.lora_epilogue import LoRATerm
from tokenmill.lora.adapter import LoRAAdapter
from tokenmill.lora.request import LoRARequest

# tokenmill's fused projection -> its PEFT modules, in slice order
SLICES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
          "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@dataclass
class LayerSlots:
    """The adapter stacks of one projection (a LinearBase of the model)."""

    a: torch.Tensor  # [S, len(slice_sizes) * rank, in_features]
    b: torch.Tensor  # [S, out_features, rank]
    rank: int
    slice_sizes: tuple[int, ...]  # output rows of each slice
    slice_starts: tuple[int, ...] = ()  # where slices 1, 2, ... begin (from slice_sizes; kept, not recomputed per step)

    def __post_init__(self):
        self.slice_starts = tuple(int(x) for x in np.cumsum(self.slice_sizes[:-1]))


class LoRAStepContext:
    """What the forward context carries for a step with adapters (layers/forward_context.py's
    LoRAHook): each token's slot and the stacks of every projection."""

    def __init__(self, token_slots: torch.Tensor, layers: dict[nn.Module, LayerSlots]):
        self.token_slots = token_slots  # [max_num_tokens] int32; a step reads its first T
        self.first_slot = token_slots[:1]  # a one-token step's
        self.layers = layers

    def gemv_term(self, module: nn.Module, x: torch.Tensor, prologue: int, norm: Optional[nn.Module],
                  residual: Optional[torch.Tensor]) -> Optional[LoRATerm]:
        """One token on the fused GEMV path: runs the shrink (the layer's prologue applied to x,
        and to x + residual with one) and returns the term the GEMV adds in its epilogue
        (kernels/lora_epilogue.py); None for a module without adapter stacks."""
        layer = self.layers.get(module)
        if layer is None:
            return None
        s = lora_shrink(x, layer.a, self.first_slot, prologue, None if norm is None else norm.weight,
                        1e-6 if norm is None else norm.eps, residual=residual)
        return LoRATerm(s, layer.b, self.first_slot, layer.rank, layer.slice_starts)

    def apply(self, module: nn.Module, x: torch.Tensor, prologue: int, norm: Optional[nn.Module],
              y: torch.Tensor) -> None:
        """y += the adapters' B @ A @ a(x) for each token (a: the prologue op before the layer)."""
        layer = self.layers.get(module)
        if layer is None:
            return
        slots = self.token_slots[: x.shape[0]]
        s = lora_shrink(x, layer.a, slots, prologue, None if norm is None else norm.weight,
                        1e-6 if norm is None else norm.eps)
        lora_expand(s, layer.b, slots, y, layer.rank, layer.slice_starts)


class LoRASlots:
    """Device slots for up to `max_loras` adapters over the model's projections."""

    def __init__(self, projections: Sequence[tuple[int, str, nn.Module]], max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device):
        """projections: (layer index, fused projection name as in SLICES, the LinearBase)."""
        self.max_loras = max_loras
        self.rank = max_rank
        self.device = device
        self.dtype = dtype
        num = max_loras + 1
        self.layers: dict[nn.Module, LayerSlots] = {}
        self._by_name: dict[tuple[int, str], LayerSlots] = {}
        for layer, name, module in projections:
            if getattr(module, "tp_size", 1) != 1:
                raise NotImplementedError("LoRA with tensor parallelism is not supported yet")
            sizes = self._slice_sizes(name, module)
            slots = LayerSlots(torch.zeros(num, len(sizes) * max_rank, module.in_features, dtype=dtype, device=device),
                               torch.zeros(num, module.out_features, max_rank, dtype=dtype, device=device),
                               max_rank, sizes)
            self.layers[module] = slots
            self._by_name[(layer, name)] = slots
        # adapter (its LoRARequest) -> slot, least recently used first
        self._slot_of: OrderedDict[LoRARequest, int] = OrderedDict()
        self._users = np.zeros(num, dtype=np.int64)  # rows using each slot
        self._free = list(range(max_loras, 0, -1))
        self.loads = 0  # adapters written to a slot (for tests and logs)

    @staticmethod
    def _slice_sizes(name: str, module: nn.Module) -> tuple[int, ...]:
        if name == "qkv_proj":
            q = module.num_heads * module.head_dim
            kv = module.num_kv_heads * module.head_dim
            return (q, kv, kv)
        if name == "gate_up_proj":
            return tuple(module.output_sizes)
        return (module.out_features,)

    def nbytes(self) -> int:
        return sum(s.a.numel() * s.a.element_size() + s.b.numel() * s.b.element_size() for s in self.layers.values())

    def resident(self) -> list[int]:
        """The lora_int_ids of the adapters in slots, least recently used first."""
        return [r.lora_int_id for r in self._slot_of]

    def acquire(self, adapter: LoRAAdapter) -> int:
        """A slot holding `adapter` for one more row (written there first if it is not resident)."""
        key = adapter.request
        slot = self._slot_of.get(key)
        if slot is None:
            slot = self._take_slot()
            self._write(slot, adapter)
            self._slot_of[key] = slot
        self._slot_of.move_to_end(key)
        self._users[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        self._users[slot] -= 1

    def forget(self, request: LoRARequest) -> None:
        """The adapter was removed: its slot is free at once if no row uses it (else it is evicted
        first when a slot is needed, as the least recently used)."""
        slot = self._slot_of.get(request)
        if slot is None:
            return
        self._slot_of.move_to_end(request, last=False)
        if self._users[slot] == 0:
            del self._slot_of[request]
            self._free.append(slot)

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        for key, slot in self._slot_of.items():  # least recently used first
            if self._users[slot] == 0:
                del self._slot_of[key]
                return slot
        raise RuntimeError(f"all {self.max_loras} LoRA slots are in use by running requests (the scheduler "
                           "admits at most max_loras distinct adapters)")

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        r = self.rank
        for (layer, name), slots in self._by_name.items():
            a = torch.zeros(slots.a.shape[1:], dtype=self.dtype)
            b = torch.zeros(slots.b.shape[1:], dtype=self.dtype)
            start = 0
            for j, (module, size) in enumerate(zip(SLICES[name], slots.slice_sizes)):
                w = adapter.modules.get((layer, module))
                if w is not None:
                    a[j * r : j * r + w.rank] = w.a
                    b[start : start + size, : w.rank] = w.b
                start += size
            slots.a[slot].copy_(_host_to(a, self.device), non_blocking=True)
            slots.b[slot].copy_(_host_to(b, self.device), non_blocking=True)
        self.loads += 1


def _host_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor for a non-blocking copy to `device` (pinned on CUDA, so the copy is ordered on the
    stream and the CPU may go on)."""
    return t if device.type == "cpu" else t.pin_memory()


def lora_projections(model: nn.Module) -> list[tuple[int, str, nn.Module]]:
    """(layer, fused projection name, module) of a Llama-family model's decoder layers: attention,
    and the dense MLP or a mixture-of-experts layer's shared expert (its experts take no adapter)."""
    out = []
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        out += [(i, "qkv_proj", attn.qkv_proj), (i, "o_proj", attn.o_proj)]
        mlp = mlp if hasattr(mlp, "gate_up_proj") else getattr(mlp, "shared_expert", None)
        if mlp is not None:
            out += [(i, "gate_up_proj", mlp.gate_up_proj), (i, "down_proj", mlp.down_proj)]
    return out

