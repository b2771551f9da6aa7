"""N-gram prompt lookup: the Triton kernel (interpreter on CPU, real shapes on CUDA) and the torch
version against the plain-Python reference, on random histories with planted repeats and on the
edge cases (short histories, no match, a match at the very end, k past the history's end,
min_n == max_n, rows in any idx_mapping order, stale tokens past a row's length)."""

import random

import pytest
import torch

from tokenmill.kernels.ngram_propose import (ngram_lookup, ngram_propose, ngram_propose_ref, ngram_propose_torch,
                                             ngram_propose_triton)

from tests.kernels.common import DEVICES


def random_history(rng: random.Random, length: int, vocab: int) -> list[int]:
    """Random tokens with a few copied spans (the repeats prompt lookup is for)."""
    h = [rng.randrange(vocab) for _ in range(length)]
    for _ in range(rng.randrange(4)):
        if length < 4:
            break
        n = rng.randrange(1, min(12, length // 2) + 1)
        src, dst = rng.randrange(length - n + 1), rng.randrange(length - n + 1)
        h[dst:dst + n] = h[src:src + n]
    return h


def make_table(histories: list[list[int]], width: int, device, rows=None, dtype=torch.int32, seed=0):
    """A token table holding each history in its row (rows[i], default i) and random stale tokens past
    the row's length; returns (table, num_tokens by row, idx_mapping with two padding entries)."""
    rows = list(range(len(histories))) if rows is None else rows
    num_rows = max(rows, default=0) + 1
    gen = torch.Generator().manual_seed(seed)
    table = torch.randint(0, 1000, (num_rows, width), generator=gen, dtype=torch.int32)
    num_tokens = torch.randint(0, width, (num_rows,), generator=gen)
    for r, h in zip(rows, histories):
        table[r, :len(h)] = torch.tensor(h, dtype=torch.int32)
        num_tokens[r] = len(h)
    idx = torch.tensor(rows + [0, 0], dtype=torch.int64)
    return table.to(device), num_tokens.to(dtype).to(device), idx.to(device)


def check_all(histories, k, min_n, max_n, device, rows=None, block_e=None, width=None):
    width = width or max(max(map(len, histories), default=1), 1)
    table, num_tokens, idx = make_table(histories, width, device, rows)
    n = len(histories)
    ref_ids, ref_counts = ngram_propose_ref(idx, n, table, num_tokens, k, min_n, max_n)
    kw = {} if block_e is None else {"block_e": block_e}
    for ids, counts in (ngram_propose_triton(idx, n, table, num_tokens, k, min_n, max_n, **kw),
                        ngram_propose_torch(idx, n, table, num_tokens, k, min_n, max_n)):
        assert torch.equal(counts.cpu(), ref_counts.cpu())
        assert torch.equal(ids.cpu(), ref_ids.cpu())
    return ref_ids.cpu(), ref_counts.cpu()


def test_lookup_definition():
    assert ngram_lookup([1, 2, 3, 9, 1, 2, 3], 2, 1, 3) == [9, 1]  # the 3-gram 1 2 3 at 0
    assert ngram_lookup([1, 2, 7, 1, 2, 8, 1, 2], 4, 2, 2) == [8, 1, 2]  # the latest of two matches
    assert ngram_lookup([4, 1, 2, 5, 3, 2], 3, 1, 3) == [5, 3, 2]  # only the 1-gram "2" matches
    assert ngram_lookup([4, 1, 2, 5, 3, 2], 3, 2, 3) == []  # ... which is shorter than min_n
    assert ngram_lookup([7, 7, 7, 7], 5, 2, 3) == [7]  # overlapping match, one token before the end
    assert ngram_lookup([5], 3, 1, 1) == [] and ngram_lookup([], 3, 1, 1) == []
    with pytest.raises(ValueError):
        ngram_lookup([1, 2], 0, 1, 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(3))
def test_random_histories(device, seed):
    rng = random.Random(seed)
    histories = [random_history(rng, rng.randrange(0, 300), rng.choice([3, 20, 1000])) for _ in range(6)]
    min_n = rng.randrange(1, 3)
    check_all(histories, rng.randrange(1, 9), min_n, min_n + rng.randrange(3), device, block_e=32)


@pytest.mark.parametrize("device", DEVICES)
def test_edge_cases(device):
    histories = [
        [], [5], [5, 5], [1, 2],  # too short / a single earlier token
        [1, 2, 3, 4, 5, 6],  # no match
        [9, 8, 7, 1, 2, 9, 8, 7],  # the match needs the whole history
        [3, 4, 1, 2, 3, 4],  # follows the match: 1 2 3 4 (k larger than what follows)
        [6, 1, 2, 6],  # 1-gram only
    ]
    ids, counts = check_all(histories, 6, 1, 3, device)
    assert counts.tolist() == [0, 0, 1, 0, 0, 5, 4, 3]
    assert ids[6].tolist() == [1, 2, 3, 4, -1, -1]
    check_all(histories, 6, 2, 2, device)  # min_n == max_n


@pytest.mark.parametrize("device", DEVICES)
def test_rows_in_any_order(device):
    rng = random.Random(7)
    histories = [random_history(rng, rng.randrange(20, 120), 8) for _ in range(5)]
    check_all(histories, 4, 1, 4, device, rows=[9, 2, 6, 0, 4], width=150)


@pytest.mark.parametrize("device", DEVICES)
def test_latest_match_across_blocks(device):
    """Several full matches in different scan blocks: the latest wins, the early stop keeps it."""
    h = [1, 2, 3, 50, 51] + list(range(100, 140)) + [1, 2, 3, 60, 61] + list(range(200, 230)) + [1, 2, 3]
    for block_e in (4, 16, 256):
        table, num_tokens, idx = make_table([h], len(h) + 3, device)
        ids, counts = ngram_propose_triton(idx, 1, table, num_tokens, 3, 1, 3, block_e=block_e)
        assert counts.tolist() == [3] and ids.tolist() == [[60, 61, 200]]


def test_dispatch_into_buffers():
    rng = random.Random(3)
    histories = [random_history(rng, 200, 6) for _ in range(4)]
    table, num_tokens, idx = make_table(histories, 256, "cpu", dtype=torch.int64)
    ids_buf, counts_buf = torch.full((8, 5), 99, dtype=torch.int32), torch.full((8,), 99, dtype=torch.int32)
    ids, counts = ngram_propose(idx, 4, table, num_tokens, 5, 2, 4, ids_buf, counts_buf)
    ref_ids, ref_counts = ngram_propose_ref(idx, 4, table, num_tokens, 5, 2, 4)
    assert torch.equal(ids, ref_ids) and torch.equal(counts, ref_counts)
    assert ids.data_ptr() == ids_buf.data_ptr() and (counts_buf[4:] == 99).all()


def test_torch_on_long_histories():
    rng = random.Random(11)
    histories = [random_history(rng, rng.randrange(2000, 4000), rng.choice([50, 30000])) for _ in range(4)]
    table, num_tokens, idx = make_table(histories, 4096, "cpu")
    ids, counts = ngram_propose_torch(idx, 4, table, num_tokens, 8, 1, 4)
    ref_ids, ref_counts = ngram_propose_ref(idx, 4, table, num_tokens, 8, 1, 4)
    assert torch.equal(ids, ref_ids) and torch.equal(counts, ref_counts)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 4, 7])
def test_real_shapes_gpu(k):
    """256 requests in a 256 x 32,768 table, histories up to 16k tokens: the kernel against the torch
    version on the device, and against the reference on a few rows."""
    rng = random.Random(k)
    histories = [random_history(rng, rng.randrange(0, 16384), rng.choice([50, 1000, 128000])) for _ in range(256)]
    rows = rng.sample(range(256), 256)
    table, num_tokens, idx = make_table(histories, 32768, "cuda", rows=rows)
    ids, counts = ngram_propose(idx, 256, table, num_tokens, k, 1, 4)
    t_ids, t_counts = ngram_propose_torch(idx, 256, table, num_tokens, k, 1, 4)
    assert torch.equal(ids, t_ids) and torch.equal(counts, t_counts)
    ref_ids, ref_counts = ngram_propose_ref(idx[:16], 16, table, num_tokens, k, 1, 4)
    assert torch.equal(ids[:16].cpu(), ref_ids.cpu()) and torch.equal(counts[:16].cpu(), ref_counts.cpu())
