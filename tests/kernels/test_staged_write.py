"""apply_staged_writes: the Triton kernel against the torch reference (interpreter on CPU, real
shapes on CUDA). Tables start filled with a sentinel, so a missed or stray write shows up."""

import os

import pytest
import torch

from tokenmill.kernels.staged_write import apply_staged_writes, apply_staged_writes_ref
from tokenmill.kernels.staged_write_triton import apply_staged_writes_triton

from tests.kernels.common import DEVICES  # noqa: F401

SENTINEL = -7


def make_writes(num_rows: int, width: int, num_writes: int, max_len: int, index_dtype, value_dtype,
                gen: torch.Generator):
    """Non-overlapping writes (distinct rows, one range each), some empty, values packed back to back."""
    rows = torch.randperm(num_rows, generator=gen)[:num_writes]
    lens = torch.randint(0, max_len + 1, (num_writes,), generator=gen)
    lens[0] = max_len  # at least one write spans several blocks
    if num_writes > 1:
        lens[1] = 0
    starts = torch.stack([torch.randint(0, width - int(n) + 1, (1,), generator=gen)[0] for n in lens])
    offsets = torch.cumsum(lens, 0) - lens
    total = int(lens.sum())
    if value_dtype.is_floating_point:
        # bf16-representable, so a narrowing store is exact (the interpreter truncates fp32 -> bf16
        # where CUDA rounds to nearest).
        values = torch.randn(total, generator=gen).to(torch.bfloat16).to(value_dtype)
    else:
        values = torch.randint(0, 100000, (total,), generator=gen).to(value_dtype)
    return [t.to(index_dtype) for t in (rows, starts, lens, offsets)] + [values]


def _cases(device):
    if device == "cpu":
        return [(16, 1200, 6, 1100, torch.int32, torch.int32, torch.int64),
                (8, 64, 5, 64, torch.int64, torch.int64, torch.int32),
                (8, 40, 4, 40, torch.float32, torch.int32, torch.float32),
                (8, 40, 4, 40, torch.bfloat16, torch.int64, torch.float32)]
    return [(256, 32768, 200, 8192, torch.int32, torch.int32, torch.int64),  # token table
            (256, 2048, 256, 64, torch.int32, torch.int32, torch.int32),  # block table
            (256, 4096, 100, 4096, torch.float32, torch.int64, torch.float32)]


@pytest.mark.parametrize("device", DEVICES)
def test_staged_writes_match_reference(device):
    gen = torch.Generator().manual_seed(0)
    for num_rows, width, num_writes, max_len, table_dtype, index_dtype, value_dtype in _cases(device):
        writes = [t.to(device) for t in make_writes(num_rows, width, num_writes, max_len, index_dtype,
                                                    value_dtype, gen)]
        table = torch.full((num_rows, width), SENTINEL, dtype=table_dtype, device=device)
        ref = table.clone()
        apply_staged_writes_ref(ref, *writes)
        apply_staged_writes_triton(table, *writes)
        assert torch.equal(table, ref), (table_dtype, index_dtype, value_dtype)
        # Every targeted element changed (values never equal the sentinel) and nothing else did.
        written = int((table != SENTINEL).sum())
        assert written == int(writes[2].long().sum())


@pytest.mark.parametrize("device", DEVICES)
def test_staged_writes_empty_and_dispatch(device):
    table = torch.full((4, 8), SENTINEL, dtype=torch.int32, device=device)
    empty = torch.zeros(0, dtype=torch.int32, device=device)
    apply_staged_writes_triton(table, empty, empty, empty, empty, empty)
    assert (table == SENTINEL).all()
    idx = lambda *v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    apply_staged_writes(table, idx(2, 0), idx(5, 0), idx(3, 2), idx(0, 3), idx(1, 2, 3, 4, 5))
    expected = torch.full((4, 8), SENTINEL, dtype=torch.int32)
    expected[2, 5:8] = torch.tensor([1, 2, 3], dtype=torch.int32)
    expected[0, 0:2] = torch.tensor([4, 5], dtype=torch.int32)
    assert torch.equal(table.cpu(), expected)


def test_staged_writes_on_a_strided_table():
    """A row-sliced view of a wider table (unit column stride) is written in place."""
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs the interpreter or CUDA")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = torch.full((6, 20), SENTINEL, dtype=torch.int64, device=device)
    view = base[:, 4:14]
    idx = lambda *v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    ref = base.clone()
    apply_staged_writes_ref(ref[:, 4:14], idx(1, 5), idx(3, 0), idx(7, 10), idx(0, 7), torch.arange(17, device=device))
    apply_staged_writes_triton(view, idx(1, 5), idx(3, 0), idx(7, 10), idx(0, 7), torch.arange(17, device=device))
    assert torch.equal(base, ref)
