"""GPU-native input preparation: from per-request step descriptors to the model's flat inputs.

Per batch entry b (request row r = idx_mapping[b], q_len = qsl[b+1] - qsl[b] new tokens starting at
position start_pos[b]):
  positions     start_pos[b] + i
  input_ids     token_table[r, pos] if pos < num_prefill[r] else last_sampled[r]
  slot_mapping  block_table[r, pos // block_size] * block_size + pos % block_size
  seq_lens[b]   start_pos[b] + q_len
  logits_idx[b] qsl[b+1] - 1  (the last new token)
  block_tables_out[b] = block_table[r]
Entries past num_reqs up to the padded batch size are padding: q_len 0, seq_len 0, slot -1.

post_update writes each sampled token into last_sampled[r] (and the penalty counts), on the device,
so the next step's input_ids never pass through the CPU.
"""

from typing import Optional

import torch

from tokenmill.kernels._dispatch import use_triton


def prepare_inputs_ref(idx_mapping, query_start_loc, start_pos, num_reqs: int, num_tokens: int,
                       token_table, num_prefill, last_sampled, block_table, block_size: int,
                       input_ids, positions, seq_lens, slot_mapping, logits_indices, block_tables_out) -> None:
    device = token_table.device
    qsl = query_start_loc[: num_reqs + 1].long()
    q_lens = qsl[1:] - qsl[:-1]
    req = torch.repeat_interleave(torch.arange(num_reqs, device=device), q_lens, output_size=num_tokens)
    rows = idx_mapping[:num_reqs].long()
    tok_rows = rows[req]
    pos = start_pos[:num_reqs].long()[req] + (torch.arange(num_tokens, device=device) - qsl[:-1][req])
    from_table = pos < num_prefill.long()[tok_rows]
    table_ids = token_table[tok_rows, pos.clamp(max=token_table.shape[1] - 1)].long()
    input_ids[:num_tokens] = torch.where(from_table, table_ids, last_sampled.long()[tok_rows])
    positions[:num_tokens] = pos
    blocks = block_table[tok_rows, pos // block_size].long()
    slot_mapping[:num_tokens] = blocks * block_size + pos % block_size
    seq_lens[:num_reqs] = (start_pos[:num_reqs].long() + q_lens).to(seq_lens.dtype)
    logits_indices[:num_reqs] = qsl[1:] - 1
    block_tables_out[:num_reqs] = block_table[rows]
    # padding
    input_ids[num_tokens:] = 0
    positions[num_tokens:] = 0
    slot_mapping[num_tokens:] = -1
    seq_lens[num_reqs:] = 0
    logits_indices[num_reqs:] = 0


def post_update_ref(idx_mapping, sampled, sample_mask, num_reqs: int, last_sampled,
                    output_counts: Optional[torch.Tensor] = None) -> None:
    rows = idx_mapping[:num_reqs].long()
    mask = sample_mask[:num_reqs].bool()
    tokens = sampled[:num_reqs].long()
    last_sampled[rows] = torch.where(mask, tokens, last_sampled[rows].long()).to(last_sampled.dtype)
    if output_counts is not None:
        output_counts.index_put_((rows, tokens), mask.to(output_counts.dtype), accumulate=True)


def prepare_inputs(*args, **kwargs) -> None:
    token_table = kwargs.get("token_table", args[5] if len(args) > 5 else None)
    if use_triton(token_table):
        from tokenmill.kernels.input_prep_triton import prepare_inputs_triton

        prepare_inputs_triton(*args, **kwargs)
    else:
        prepare_inputs_ref(*args, **kwargs)


def post_update(idx_mapping, sampled, sample_mask, num_reqs: int, last_sampled, output_counts=None) -> None:
    if use_triton(last_sampled):
        from tokenmill.kernels.input_prep_triton import post_update_triton

        post_update_triton(idx_mapping, sampled, sample_mask, num_reqs, last_sampled, output_counts)
    else:
        post_update_ref(idx_mapping, sampled, sample_mask, num_reqs, last_sampled, output_counts)
