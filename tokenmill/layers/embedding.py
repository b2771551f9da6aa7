"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed import get_tp_state, tp_all_gather, tp_all_reduce
from tokenmill.kernels.batch_invariant import linear_invariant
from tokenmill.layers.linear import LayerLoader


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype=None, device=None):
        super().__init__()
        self.tp = get_tp_state()
        self.tp_rank, self.tp_size = self.tp.tp_rank, self.tp.tp_size
        self.vocab_size = vocab_size
        # Pad the vocabulary so that it splits evenly; padded rows are never looked up.
        self.rows_per_rank = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.weight = nn.Parameter(
            torch.empty(self.rows_per_rank, hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        # the layer held weakly: a bound method on its own parameter would be a reference cycle
        self.weight.weight_loader = LayerLoader(self, type(self).weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[1] != param.shape[1] or loaded.shape[0] != self.vocab_size:
            raise ValueError(
                f"shape mismatch loading the embedding: checkpoint {tuple(loaded.shape)}, "
                f"model ({self.vocab_size}, {param.shape[1]})"
            )
        part = loaded[self.vocab_start : self.vocab_start + self.rows_per_rank]
        param.data[: part.shape[0]].copy_(part)
        param.data[part.shape[0] :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return tp_all_reduce(out, self.tp)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> logits over the vocabulary; may share its weight with the input embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype=None, device=None):
        super().__init__(vocab_size, hidden_size, dtype, device)
        self.batch_invariant = False  # kernels/batch_invariant.py's matmul (layers/invariance.py sets it per model)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear_invariant(hidden, self.weight) if self.batch_invariant else F.linear(hidden, self.weight)
        logits = tp_all_gather(logits, dim=-1, state=self.tp)
        return logits[..., : self.vocab_size]
