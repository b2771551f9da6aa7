"""LayerTruncatedProposer: the target's own first N decoder layers, its final norm and LM head
draft k tokens greedily (a self-draft: no second model).

Layer i < N of the truncated pass computes, for a real token, exactly the K/V the target's layer i
computes (same weights, same inputs), so the draft shares the target's KV cache for those layers:
no replay of the step, no memory of its own. Its k draft steps (draft_loop.py) write K/V in layers
< N at positions ahead of what the target has verified; the target overwrites each of them when it
computes that position, before any read, and the scheduler reserves the k slots they need
(SpeculativeConfig.num_lookahead_tokens).
"""

import torch

from tokenmill.config import ConfigError
from tokenmill.layers.forward_context import AttentionMetadata, forward_context
from tokenmill.runner.spec_decode.draft_loop import GreedyDraftLoop, draft_capture_sizes
from tokenmill.runner.spec_decode.proposer import DraftTokens, Proposer, ProposerInputs


def check_num_draft_layers(num_draft_layers: int, target_layers: int) -> None:
    if not 1 <= num_draft_layers < target_layers:
        raise ConfigError(f"num_draft_layers must be in 1..{target_layers - 1} (the target has {target_layers} "
                          f"decoder layers; a draft of all of them is the target itself), got {num_draft_layers}")


class LayerTruncatedProposer(Proposer):
    needs_step_inputs = True

    def __init__(self, target: torch.nn.Module, num_draft_layers: int, k: int, max_num_reqs: int,
                 max_model_len: int, block_size: int, device: torch.device, small_batch_fusion: bool = True):
        check_num_draft_layers(num_draft_layers, target.attention_spec().num_layers)
        if not callable(getattr(target, "forward_first_layers", None)):
            raise ConfigError(f"{type(target).__name__} cannot run a truncated forward pass "
                              "(forward_first_layers), so it cannot draft for itself")
        self.model = target
        self.num_layers = num_draft_layers
        self.small_batch_fusion = small_batch_fusion
        self.kv_caches: list = []  # the target's, once bound; layers < num_layers are used
        self.loop = GreedyDraftLoop(self._logits, k, max_num_reqs, max_model_len, block_size, device)

    def bind_kv_cache(self, num_blocks: int, target_kv_caches) -> None:
        self.kv_caches = target_kv_caches

    def _logits(self, meta: AttentionMetadata, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        with forward_context(meta, self.kv_caches, None, self.small_batch_fusion):
            hidden = self.model.forward_first_layers(input_ids, positions, self.num_layers)
        return self.model.compute_logits(hidden)

    def propose(self, inputs: ProposerInputs) -> DraftTokens:
        if inputs.block_table is None or inputs.slot_limit is None:
            raise ValueError("the layer-truncated draft needs the block table and the slot limits")
        return self.loop.run(inputs.idx_mapping, inputs.num_reqs, inputs.token_table, inputs.num_tokens,
                             inputs.block_table, inputs.slot_limit, inputs.draft_mask)

    def capture_cuda_graphs(self, max_batch: int) -> None:
        self.loop.capture(draft_capture_sizes(max_batch))
