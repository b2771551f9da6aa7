"""apply_token_bitmask: the Triton kernel against the torch reference and a plain-Python reading of
the layout (bit j of word w allows token 32 w + j); interpreter on CPU at small shapes, a
151936-token vocabulary on CUDA."""

import pytest
import torch

from tokenmill.kernels.token_bitmask import apply_token_bitmask, apply_token_bitmask_ref
from tokenmill.kernels.token_bitmask_triton import apply_token_bitmask_triton

from tests.kernels.common import DEVICES


def random_mask(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    words = -(-vocab // 32)
    mask = torch.randint(-2**31, 2**31, (rows, words), generator=gen, dtype=torch.int64).to(torch.int32)
    mask[0] = -1  # a row that allows everything
    if rows > 1:
        mask[1] = 0  # and one that allows nothing
    if rows > 2:  # a single allowed token
        mask[2] = 0
        mask[2, 3] = 1 << 2
    return mask


def test_reference_reads_the_layout():
    gen = torch.Generator().manual_seed(0)
    vocab = 100
    mask = random_mask(4, vocab, gen)
    logits = torch.randn(4, vocab, generator=gen)
    out = logits.clone()
    apply_token_bitmask_ref(out, mask)
    for b in range(4):
        for t in range(vocab):
            allowed = (int(mask[b, t // 32]) >> (t % 32)) & 1
            assert (out[b, t] == logits[b, t]) if allowed else out[b, t] == float("-inf")
    assert out[2].isfinite().sum() == 1 and out[2, 3 * 32 + 2].isfinite()


@pytest.mark.parametrize("device", DEVICES)
def test_triton_matches_reference(device):
    gen = torch.Generator().manual_seed(1)
    shapes = [(5, 100), (3, 2049), (1, 32)] if device == "cpu" else [(1, 151936), (64, 151936), (7, 151937)]
    for rows, vocab in shapes:
        mask = random_mask(rows, vocab, gen)
        logits = torch.randn(rows, vocab, generator=gen)
        ref = logits.clone()
        apply_token_bitmask_ref(ref, mask)
        out = logits.to(device)
        apply_token_bitmask_triton(out, mask.to(device))
        assert torch.equal(out.cpu(), ref)


@pytest.mark.parametrize("device", DEVICES)
def test_dispatch_and_strided_rows(device):
    """A row slice of a wider buffer (stride > V), through the dispatcher."""
    gen = torch.Generator().manual_seed(2)
    vocab = 300 if device == "cpu" else 151936
    base = torch.randn(4, vocab + 16, generator=gen)
    mask = random_mask(4, vocab, gen)
    ref = base[:, :vocab].clone()
    apply_token_bitmask_ref(ref, mask)
    dev = base.to(device)
    view = dev[:, :vocab]
    (apply_token_bitmask_triton if device == "cpu" else apply_token_bitmask)(view, mask.to(device))
    assert torch.equal(view.cpu(), ref)
    assert torch.equal(dev[:, vocab:].cpu(), base[:, vocab:])  # nothing written past the row
