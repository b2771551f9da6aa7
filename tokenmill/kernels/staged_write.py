"""Applying staged ragged writes to a 2-D device table: write i puts values[offsets[i]:offsets[i]+lens[i]]
at table[rows[i], starts[i]:starts[i]+lens[i]]."""

import torch

from tokenmill.kernels._dispatch import use_triton


def apply_staged_writes_ref(table: torch.Tensor, rows, starts, lens, offsets, values) -> None:
    n = rows.shape[0]
    if n == 0:
        return
    total = values.shape[0]
    # Which write each value belongs to, and its column.
    write_of_value = torch.repeat_interleave(torch.arange(n, device=table.device), lens.long(), output_size=total)
    cols = starts.long()[write_of_value] + (torch.arange(total, device=table.device) - offsets.long()[write_of_value])
    table[rows.long()[write_of_value], cols] = values.to(table.dtype)


def apply_staged_writes(table, rows, starts, lens, offsets, values) -> None:
    if use_triton(table):
        from tokenmill.kernels.staged_write_triton import apply_staged_writes_triton

        apply_staged_writes_triton(table, rows, starts, lens, offsets, values)
    else:
        apply_staged_writes_ref(table, rows, starts, lens, offsets, values)
