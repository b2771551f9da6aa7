"""NgramProposer: draft tokens by n-gram lookup in each request's own history.

The last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are looked up among the
earlier tokens of the same row; the latest earlier occurrence of the longest matching n-gram gives
the draft, the up to k tokens that followed it (see kernels/ngram_propose.py). Stateless per row;
the outputs live in buffers the proposer keeps, so the tensors of a step's DraftTokens are
overwritten by the next propose().
"""

import torch

from tokenmill.kernels.ngram_propose import ngram_propose
from tokenmill.runner.spec_decode.proposer import DraftTokens, Proposer, ProposerInputs


class NgramProposer(Proposer):
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, max_num_reqs: int,
                 max_k: int, device: torch.device):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if max_k < 1:
            raise ValueError("need max_k >= 1")
        self.min_n, self.max_n, self.max_k = prompt_lookup_min, prompt_lookup_max, max_k
        self._ids = torch.full((max_num_reqs * max_k,), -1, dtype=torch.int32, device=device)
        self._counts = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)

    def propose(self, inputs: ProposerInputs) -> DraftTokens:
        if not 1 <= inputs.k <= self.max_k:
            raise ValueError(f"k={inputs.k} is outside 1..{self.max_k}")
        n = inputs.num_reqs
        ids = self._ids[:n * inputs.k].view(n, inputs.k)  # contiguous for any k
        draft_ids, num_drafts = ngram_propose(inputs.idx_mapping, n, inputs.token_table, inputs.num_tokens,
                                              inputs.k, self.min_n, self.max_n, ids, self._counts)
        return DraftTokens(draft_ids, num_drafts)
