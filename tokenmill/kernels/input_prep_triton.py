"""Triton versions of prepare_inputs and post_update (see input_prep.py for the semantics).

prepare_inputs runs one program per batch entry: entry b < num_reqs writes its own tokens and its
per-request outputs; entries past num_reqs write the padding of seq_lens / logits_indices; and all
programs share, grid-stride, the token padding [num_tokens, len(buffer)) of each token buffer.
Nothing here reads a tensor value on the host.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

BLOCK_T = 128  # tokens per step of a request's loop (decode entries use one lane)
BLOCK_B = 256  # block-table columns per step of the row copy
BLOCK_PAD = 1024  # padding tokens per step


@triton.jit
def _write_request_tokens(
    b, r, start_pos,
    qsl_ptr, token_table_ptr, num_prefill_ptr, last_sampled_ptr, block_table_ptr,
    input_ids_ptr, positions_ptr, slot_mapping_ptr,
    table_width, bt_width, stride_tt, stride_bt,
    BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """input_ids / positions / slot_mapping of entry b's new tokens; returns (q_start, q_end)."""
    q_start = tl.load(qsl_ptr + b).to(tl.int64)
    q_end = tl.load(qsl_ptr + b + 1).to(tl.int64)
    prefill_len = tl.load(num_prefill_ptr + r).to(tl.int64)
    last = tl.load(last_sampled_ptr + r).to(tl.int64)
    lanes = tl.arange(0, BLOCK_T)
    for i in range(0, q_end - q_start, BLOCK_T):
        tok = q_start + i + lanes
        mask = tok < q_end
        pos = start_pos + i + lanes
        from_table = mask & (pos < prefill_len)
        # The reference clamps the column, so a (masked-out) read never leaves the row.
        col = tl.minimum(pos, table_width - 1)
        ids = tl.load(token_table_ptr + r * stride_tt + col, mask=from_table, other=0).to(tl.int64)
        ids = tl.where(from_table, ids, last)
        blk_col = pos // BLOCK_SIZE
        blk = tl.load(block_table_ptr + r * stride_bt + blk_col, mask=mask & (blk_col < bt_width), other=0)
        slot = blk.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        tl.store(input_ids_ptr + tok, ids.to(input_ids_ptr.dtype.element_ty), mask=mask)
        tl.store(positions_ptr + tok, pos.to(positions_ptr.dtype.element_ty), mask=mask)
        tl.store(slot_mapping_ptr + tok, slot.to(slot_mapping_ptr.dtype.element_ty), mask=mask)
    return q_start, q_end


@triton.jit
def _copy_block_table_row(b, r, block_table_ptr, block_tables_out_ptr, bt_width, stride_bt, stride_bto,
                          BLOCK_B: tl.constexpr):
    cols = tl.arange(0, BLOCK_B)
    for c in range(0, bt_width, BLOCK_B):
        mask = c + cols < bt_width
        v = tl.load(block_table_ptr + r * stride_bt + c + cols, mask=mask)
        tl.store(block_tables_out_ptr + b * stride_bto + c + cols,
                 v.to(block_tables_out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_token_padding(input_ids_ptr, positions_ptr, slot_mapping_ptr, num_tokens,
                         n_ids, n_pos, n_slots, BLOCK_PAD: tl.constexpr):
    """Programs split the padding tail of each token buffer (up to its own length) grid-stride."""
    pad_end = tl.maximum(tl.maximum(n_ids, n_pos), n_slots)
    lanes = tl.arange(0, BLOCK_PAD)
    first = num_tokens + tl.program_id(0) * BLOCK_PAD
    step = tl.num_programs(0) * BLOCK_PAD
    for t0 in range(first, pad_end, step):
        tok = t0 + lanes
        tl.store(input_ids_ptr + tok, tl.zeros_like(tok).to(input_ids_ptr.dtype.element_ty), mask=tok < n_ids)
        tl.store(positions_ptr + tok, tl.zeros_like(tok).to(positions_ptr.dtype.element_ty), mask=tok < n_pos)
        tl.store(slot_mapping_ptr + tok, tl.full(tok.shape, -1, slot_mapping_ptr.dtype.element_ty),
                 mask=tok < n_slots)


# Sizes that change from step to step are not specialised on (no recompiles as the batch varies).
@triton.jit(do_not_specialize=["num_reqs", "num_tokens", "n_ids", "n_pos", "n_slots", "n_seq", "n_logits"])
def _prepare_inputs_kernel(
    idx_mapping_ptr, qsl_ptr, start_pos_ptr, token_table_ptr, num_prefill_ptr, last_sampled_ptr,
    block_table_ptr,
    input_ids_ptr, positions_ptr, seq_lens_ptr, slot_mapping_ptr, logits_indices_ptr, block_tables_out_ptr,
    num_reqs, num_tokens, table_width, bt_width,
    n_ids, n_pos, n_slots, n_seq, n_logits,
    stride_tt, stride_bt, stride_bto,
    BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    if b < num_reqs:
        r = tl.load(idx_mapping_ptr + b).to(tl.int64)
        start_pos = tl.load(start_pos_ptr + b).to(tl.int64)
        q_start, q_end = _write_request_tokens(
            b, r, start_pos, qsl_ptr, token_table_ptr, num_prefill_ptr, last_sampled_ptr, block_table_ptr,
            input_ids_ptr, positions_ptr, slot_mapping_ptr, table_width, bt_width, stride_tt, stride_bt,
            BLOCK_SIZE, BLOCK_T,
        )
        seq_len = start_pos + (q_end - q_start)
        tl.store(seq_lens_ptr + b, seq_len.to(seq_lens_ptr.dtype.element_ty))
        tl.store(logits_indices_ptr + b, (q_end - 1).to(logits_indices_ptr.dtype.element_ty))
        _copy_block_table_row(b, r, block_table_ptr, block_tables_out_ptr, bt_width, stride_bt, stride_bto,
                              BLOCK_B)
    else:
        # Padding entries: seq_len 0 and logits index 0 (their block-table rows are left as they are).
        if b < n_seq:
            tl.store(seq_lens_ptr + b, tl.zeros([], seq_lens_ptr.dtype.element_ty))
        if b < n_logits:
            tl.store(logits_indices_ptr + b, tl.zeros([], logits_indices_ptr.dtype.element_ty))
    _write_token_padding(input_ids_ptr, positions_ptr, slot_mapping_ptr, num_tokens, n_ids, n_pos, n_slots,
                         BLOCK_PAD)


def _check_1d(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert t.dim() == 1 and (t.stride(0) == 1 or t.shape[0] <= 1), "1-D contiguous tensors expected"


def _check_rows(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert t.dim() == 2 and (t.stride(1) == 1 or t.shape[1] <= 1), "2-D tensors with unit column stride expected"


def prepare_inputs_triton(idx_mapping, query_start_loc, start_pos, num_reqs: int, num_tokens: int,
                          token_table, num_prefill, last_sampled, block_table, block_size: int,
                          input_ids, positions, seq_lens, slot_mapping, logits_indices, block_tables_out) -> None:
    """Fills the output buffers in place, padding included, with prepare_inputs_ref's values.
    query_start_loc[0] must be 0 (as the reference assumes); block_tables_out must have
    block_table's width. Recompiles only for a new block_size (a constexpr)."""
    _check_1d(idx_mapping, query_start_loc, start_pos, num_prefill, last_sampled,
              input_ids, positions, seq_lens, slot_mapping, logits_indices)
    _check_rows(token_table, block_table, block_tables_out)
    assert block_tables_out.shape[1] == block_table.shape[1], "block_tables_out must match block_table's width"
    n_ids, n_pos, n_slots = input_ids.shape[0], positions.shape[0], slot_mapping.shape[0]
    n_seq, n_logits = seq_lens.shape[0], logits_indices.shape[0]
    grid = max(num_reqs, n_seq, n_logits, 1)
    _prepare_inputs_kernel[(grid,)](
        idx_mapping, query_start_loc, start_pos, token_table, num_prefill, last_sampled, block_table,
        input_ids, positions, seq_lens, slot_mapping, logits_indices, block_tables_out,
        num_reqs, num_tokens, token_table.shape[1], block_table.shape[1],
        n_ids, n_pos, n_slots, n_seq, n_logits,
        token_table.stride(0), block_table.stride(0), block_tables_out.stride(0),
        BLOCK_SIZE=block_size, BLOCK_T=BLOCK_T, BLOCK_B=BLOCK_B, BLOCK_PAD=BLOCK_PAD, num_warps=4,
    )


@triton.jit
def _post_update_kernel(idx_mapping_ptr, sampled_ptr, sample_mask_ptr, last_sampled_ptr, counts_ptr,
                        stride_counts, HAS_COUNTS: tl.constexpr):
    b = tl.program_id(0)
    if tl.load(sample_mask_ptr + b) != 0:
        r = tl.load(idx_mapping_ptr + b).to(tl.int64)
        tok = tl.load(sampled_ptr + b).to(tl.int64)
        tl.store(last_sampled_ptr + r, tok.to(last_sampled_ptr.dtype.element_ty))
        if HAS_COUNTS:
            tl.atomic_add(counts_ptr + r * stride_counts + tok, 1)


def post_update_triton(idx_mapping, sampled, sample_mask, num_reqs: int, last_sampled,
                       output_counts: Optional[torch.Tensor] = None) -> None:
    """In place: last_sampled[idx_mapping[b]] = sampled[b] and output_counts[row, token] += 1 for
    the entries b < num_reqs whose sample_mask is set (masked-off entries are not read further)."""
    if num_reqs == 0:
        return
    _check_1d(idx_mapping, sampled, sample_mask, last_sampled)
    if sample_mask.dtype == torch.bool:
        sample_mask = sample_mask.view(torch.uint8)
    if output_counts is not None:
        _check_rows(output_counts)
    counts = output_counts if output_counts is not None else last_sampled  # unused when absent
    _post_update_kernel[(num_reqs,)](
        idx_mapping, sampled, sample_mask, last_sampled, counts,
        output_counts.stride(0) if output_counts is not None else 0,
        HAS_COUNTS=output_counts is not None, num_warps=1,
    )
