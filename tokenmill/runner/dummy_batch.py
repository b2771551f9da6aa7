"""One builder of fake batches, for every run that is not a real step: the profiling run that sizes
the KV cache, warm-up compiles, and CUDA-graph capture.

A fake batch lives in the runner's own input buffers (so strides, alignment and addresses match real
steps), touches no request state, writes no K/V (every slot is -1) and attends only to cache block 0.
"""

import numpy as np
import torch

from tokenmill.layers.forward_context import AttentionMetadata
from tokenmill.runner.input_buffers import InputBuffers


def split_tokens(num_tokens: int, num_reqs: int) -> np.ndarray:
    """Query lengths of num_reqs fake requests sharing num_tokens as evenly as possible."""
    q_lens = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int64)
    q_lens[: num_tokens % num_reqs] += 1
    return q_lens


def fill_dummy_batch(buffers: InputBuffers, q_lens: np.ndarray, padded_tokens: int = 0) -> AttentionMetadata:
    """Write a batch of fake requests with these query lengths (each its whole context) into the
    buffers; slots up to padded_tokens (padding a graph covers) are -1 too. Returns its metadata."""
    num_reqs, num_tokens = len(q_lens), int(q_lens.sum())
    qsl = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=qsl[1:])
    b = buffers
    b.input_ids[:num_tokens].zero_()
    b.positions[:num_tokens].copy_(torch.from_numpy(np.concatenate([np.arange(n) for n in q_lens])))
    b.slot_mapping[: max(num_tokens, padded_tokens)].fill_(-1)
    b.query_start_loc[: num_reqs + 1].copy_(torch.from_numpy(qsl))
    b.seq_lens[:num_reqs].copy_(torch.from_numpy(q_lens))
    b.block_tables[:num_reqs].zero_()
    b.logits_indices[:num_reqs].copy_(torch.from_numpy(qsl[1:] - 1))
    longest = int(q_lens.max())
    return AttentionMetadata(b.query_start_loc[: num_reqs + 1], b.seq_lens[:num_reqs], b.block_tables[:num_reqs],
                             b.slot_mapping[:num_tokens], max_query_len=longest, max_seq_len=longest)
