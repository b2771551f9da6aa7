"""Triton version of apply_staged_writes: one program per write, copying its values in blocks."""

import torch
import triton
import triton.language as tl

BLOCK = 512


@triton.jit
def _staged_write_kernel(
    table_ptr, rows_ptr, starts_ptr, lens_ptr, offsets_ptr, values_ptr,
    stride_row,
    BLOCK: tl.constexpr,
):
    """Write i: table[rows[i], starts[i] + j] = values[offsets[i] + j] for j < lens[i]."""
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    start = tl.load(starts_ptr + i).to(tl.int64)
    length = tl.load(lens_ptr + i).to(tl.int64)
    offset = tl.load(offsets_ptr + i).to(tl.int64)
    dst = table_ptr + row * stride_row + start
    src = values_ptr + offset
    cols = tl.arange(0, BLOCK)
    for j in range(0, length, BLOCK):
        mask = j + cols < length
        v = tl.load(src + j + cols, mask=mask)
        tl.store(dst + j + cols, v.to(table_ptr.dtype.element_ty), mask=mask)


def apply_staged_writes_triton(table: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
                               lens: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor) -> None:
    """In place on `table` (2-D, unit stride along columns). The index tensors are 1-D, one entry
    per write, any integer dtype; values is 1-D and is cast to the table's dtype on store."""
    n = rows.shape[0]
    if n == 0:
        return
    assert table.dim() == 2 and (table.stride(1) == 1 or table.shape[1] <= 1), "table needs unit column stride"
    assert values.dim() == 1 and (values.stride(0) == 1 or values.shape[0] <= 1), "values must be contiguous"
    for t in (rows, starts, lens, offsets):
        assert t.shape == (n,) and (t.stride(0) == 1 or n == 1), "index tensors must be contiguous [n]"
    _staged_write_kernel[(n,)](
        table, rows, starts, lens, offsets, values, table.stride(0), BLOCK=BLOCK, num_warps=4,
    )
