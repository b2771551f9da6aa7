"""Speculative decoding: proposers of draft tokens.

After a step's sampling, with the accepted tokens written into the token table, the runner calls
`proposer.propose(ProposerInputs(...))` once and gets `DraftTokens`: per batch entry up to k draft
ids ([num_reqs, k] int32, -1 as padding) and their count ([num_reqs] int32), both on the device, for
the next step to verify. A runner without speculation holds no proposer at all (there is no null
proposer). Proposers are RowStates: one that keeps per-row state hears of every admission and
release through add_request / remove_request; the rest inherit no-ops.

ProposerInputs carries the batch's rows (idx_mapping), the token table, each row's known token
count and k, and, for heads that read the target model's hidden states, optional hidden states and
positions.

Proposers (built from the config's method by `decoder.build_proposer`):
- NgramProposer (`ngram.py`), prompt lookup in the request's own history, on the device
  (`kernels/ngram_propose.py`);
- DraftModelProposer (`draft_model.py`), a smaller model with the target's vocabulary and a KV cache
  of its own on the target's blocks, which replays each step and then drafts greedily;
- LayerTruncatedProposer (`layer_truncated.py`), the target's first N layers drafting greedily in
  the target's own KV cache.
The last two share the k-step greedy loop of `draft_loop.py` (CUDA graphs per padded batch size)
and get the step's inputs, block table and slot limits through ProposerInputs' optional fields.
"""

from tokenmill.runner.spec_decode.ngram import NgramProposer
from tokenmill.runner.spec_decode.proposer import DraftTokens, Proposer, ProposerInputs

__all__ = ["DraftTokens", "NgramProposer", "Proposer", "ProposerInputs"]
