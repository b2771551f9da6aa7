"""DraftModelProposer: a smaller model with the target's vocabulary drafts k tokens greedily.

The draft has a KV cache of its own with the target's block size and block count, addressed by the
target's block tables and slot mappings: a row's block b holds the same positions in both caches,
so the scheduler's allocation, the prefix cache and preemption serve both without knowing of the
draft (the runner sizes the KV cache for both: `kv_bytes_per_block`).

Each step, `propose` first replays the step the target just ran (its input ids, positions and
attention metadata, still in the runner's input buffers) through the draft model: only its K/V
writes matter, so the draft's cache holds every token the target computed, prefills and other
requests' tokens included (a later request may reuse those blocks through the prefix cache). Then
the k greedy draft steps run (draft_loop.py: fixed buffers, one CUDA graph per padded batch size on
CUDA). K/V the replay writes for drafts that were rejected are overwritten when the real token at
that position is fed.
"""

import torch

from tokenmill.config import ConfigError
from tokenmill.layers.forward_context import AttentionMetadata, forward_context
from tokenmill.runner.dummy_batch import fill_dummy_batch, split_tokens
from tokenmill.runner.kv_cache import KVCacheSpec, allocate_kv_cache
from tokenmill.runner.spec_decode.draft_loop import GreedyDraftLoop, draft_capture_sizes
from tokenmill.runner.spec_decode.proposer import DraftTokens, Proposer, ProposerInputs


def check_draft_vocab(draft_vocab: int, target_vocab: int) -> None:
    """A draft proposes target token ids, so both must share one vocabulary."""
    if draft_vocab != target_vocab:
        raise ConfigError(f"the draft model's vocabulary has {draft_vocab} tokens but the target's has "
                          f"{target_vocab}: a draft model must share the target's vocabulary")


class DraftModelProposer(Proposer):
    needs_step_inputs = True

    def __init__(self, draft: torch.nn.Module, target_vocab_size: int, k: int, max_num_reqs: int,
                 max_model_len: int, block_size: int, device: torch.device, small_batch_fusion: bool = True):
        check_draft_vocab(draft.config.vocab_size, target_vocab_size)
        self.model = draft
        self.device = device
        self.small_batch_fusion = small_batch_fusion
        spec = draft.attention_spec()
        self.kv_spec = KVCacheSpec(spec.num_layers, spec.num_kv_heads, spec.head_dim, block_size, spec.dtype,
                                   spec.cache_planes)
        self.kv_caches: list = []  # per draft layer (k_cache, v_cache), once bound
        self.loop = GreedyDraftLoop(self._logits, k, max_num_reqs, max_model_len, block_size, device)

    # ---- the KV cache ------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        return self.kv_spec.bytes_per_block

    def bind_kv_cache(self, num_blocks: int, target_kv_caches) -> None:
        self.kv_caches = allocate_kv_cache(self.kv_spec, num_blocks, self.device)

    # ---- forward passes ----------------------------------------------------------------------
    def _forward(self, meta: AttentionMetadata, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches=None) -> torch.Tensor:
        with forward_context(meta, self.kv_caches if kv_caches is None else kv_caches, None,
                             self.small_batch_fusion):
            return self.model(input_ids, positions)

    def _logits(self, meta: AttentionMetadata, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(self._forward(meta, input_ids, positions))

    def propose(self, inputs: ProposerInputs) -> DraftTokens:
        if inputs.input_ids is None or inputs.attn_metadata is None or inputs.block_table is None:
            raise ValueError("the draft model needs the step's inputs and the block table")
        # The step's tokens into the draft's cache (no LM head: only the K/V writes matter).
        self._forward(inputs.attn_metadata, inputs.input_ids, inputs.positions)
        return self.loop.run(inputs.idx_mapping, inputs.num_reqs, inputs.token_table, inputs.num_tokens,
                             inputs.block_table, inputs.slot_limit, inputs.draft_mask)

    # ---- profiling and CUDA graphs -----------------------------------------------------------
    def profile_run(self, buffers, num_tokens: int, num_reqs: int) -> None:
        """The draft's forward pass at the largest step shape over a one-block cache (no K/V written)."""
        meta = fill_dummy_batch(buffers, split_tokens(num_tokens, num_reqs))
        self._forward(meta, buffers.input_ids[:num_tokens], buffers.positions[:num_tokens],
                      allocate_kv_cache(self.kv_spec, 1, self.device))

    def capture_cuda_graphs(self, max_batch: int) -> None:
        self.loop.capture(draft_capture_sizes(max_batch))

