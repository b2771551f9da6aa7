"""The runner's side of multi-LoRA: each row's adapter slot, and the step's per-token slots.

The adapters' device slots and the LoRA step context are lora/slots.py's; here a RowState gives a
request its slot when it takes a row (writing the adapter to a slot first if it is not resident)
and frees it when the row is released, and each step with adapters expands the rows' slots to one
per token in a persistent buffer (the decode and piecewise graphs of steps with adapters read it).
"""

from typing import Optional

import numpy as np
import torch

from tokenmill.config import EngineConfig
from tokenmill.logger import init_logger
from tokenmill.lora.registry import LoRARegistry
from tokenmill.lora.slots import LoRASlots, LoRAStepContext, lora_projections
from tokenmill.step_io import NewRequestData
from tokenmill.runner.request_states import RowState
from tokenmill.runner.staged_write import to_device

logger = init_logger(__name__)


class LoRARowState(RowState):
    """Each runner row's adapter slot (0: none), and the step's per-token slots."""

    def __init__(self, registry: LoRARegistry, slots: LoRASlots, max_num_reqs: int, max_num_tokens: int,
                 device: torch.device):
        self.registry = registry
        self.slots = slots
        self.device = device
        self.row_slot = np.zeros(max_num_reqs, dtype=np.int32)
        self.token_slots = torch.zeros(max_num_tokens, dtype=torch.int32, device=device)
        self.context = LoRAStepContext(self.token_slots, slots.layers)  # also what graphs capture with

    def add_request(self, row: int, new: NewRequestData) -> None:
        lora = new.lora_request
        self.row_slot[row] = 0 if lora is None else self.slots.acquire(self.registry.weights_for(lora))

    def remove_request(self, row: int) -> None:
        slot = int(self.row_slot[row])
        if slot:
            self.slots.release(slot)
            self.row_slot[row] = 0

    def has_adapters(self, rows: np.ndarray) -> bool:
        return bool(self.row_slot[rows].any())

    def step_context(self, rows: np.ndarray, q_lens: np.ndarray, padded_tokens: int) -> Optional[LoRAStepContext]:
        """The step's LoRA context, or None when no request of the batch has an adapter (then the
        step runs exactly as without LoRA). Fills the per-token slots (one copy, no sync)."""
        slots = self.row_slot[rows]
        if not slots.any():
            return None
        per_token = np.zeros(padded_tokens, dtype=np.int32)
        per_token[: int(q_lens.sum())] = np.repeat(slots, q_lens)
        self.token_slots[:padded_tokens].copy_(to_device(per_token, self.device), non_blocking=True)
        return self.context


def make_lora_state(model: torch.nn.Module, config: EngineConfig, registry: Optional[LoRARegistry],
                    max_num_tokens: int, dtype: torch.dtype, device: torch.device) -> Optional[LoRARowState]:
    """The runner's LoRA state when LoRA is enabled (registry given), else None."""
    if registry is None:
        return None
    slots = LoRASlots(lora_projections(model), config.max_loras, config.max_lora_rank, dtype, device)
    logger.info("LoRA: %d adapter slots of rank %d (%.1f MiB)", config.max_loras, config.max_lora_rank,
                slots.nbytes() / 2**20)
    return LoRARowState(registry, slots, config.max_num_seqs, max_num_tokens, device)
