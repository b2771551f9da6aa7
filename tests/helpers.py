"""Test helpers: run a model over whole sequences with a scratch paged KV cache."""

import torch

from tokenmill.layers.forward_context import AttentionMetadata, forward_context


def scratch_kv_caches(model, num_blocks: int, block_size: int = 16):
    spec = model.attention_spec()
    device = next(model.parameters()).device
    shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    if spec.latent:  # one latent plane (MLA)
        return [(c, c) for c in (torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers))]
    return [(torch.zeros(shape, dtype=spec.dtype, device=device), torch.zeros(shape, dtype=spec.dtype, device=device))
            for _ in range(spec.num_layers)]


@torch.no_grad()
def full_logits(model, sequences: list[list[int]], block_size: int = 16) -> list[torch.Tensor]:
    """Logits [len, vocab] at every position of each sequence, all sequences in one prefill batch."""
    device = next(model.parameters()).device
    blocks_per_seq = [-(-len(s) // block_size) for s in sequences]
    caches = scratch_kv_caches(model, sum(blocks_per_seq) + 1, block_size)
    max_blocks = max(blocks_per_seq)
    tables = torch.zeros(len(sequences), max_blocks, dtype=torch.int32)
    next_block, slots, positions, ids, qsl = 1, [], [], [], [0]
    for i, seq in enumerate(sequences):
        blocks = list(range(next_block, next_block + blocks_per_seq[i]))
        next_block += blocks_per_seq[i]
        tables[i, : len(blocks)] = torch.tensor(blocks)
        for p in range(len(seq)):
            slots.append(blocks[p // block_size] * block_size + p % block_size)
        positions += list(range(len(seq)))
        ids += seq
        qsl.append(qsl[-1] + len(seq))
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([len(s) for s in sequences], dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(len(s) for s in sequences),
        max_seq_len=max(len(s) for s in sequences),
    )
    with forward_context(meta, caches):
        hidden = model(torch.tensor(ids, device=device), torch.tensor(positions, device=device))
        logits = model.compute_logits(hidden)
    return list(logits.split([len(s) for s in sequences]))
