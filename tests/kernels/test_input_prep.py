"""prepare_inputs / post_update: the Triton kernels against the torch references (interpreter on
CPU at small shapes, real shapes on CUDA). Output buffers start poisoned with a sentinel and are
longer than the step needs (persistent, padded buffers), so every element must be written."""

import os
from dataclasses import dataclass

import pytest
import torch

from tokenmill.kernels.input_prep import post_update, post_update_ref, prepare_inputs, prepare_inputs_ref
from tokenmill.kernels.input_prep_triton import post_update_triton, prepare_inputs_triton

from tests.kernels.common import DEVICES  # noqa: F401

SENTINEL = 777777
OUTPUTS = ("input_ids", "positions", "seq_lens", "slot_mapping", "logits_indices", "block_tables_out")

# (inputs: idx_mapping, query_start_loc, start_pos, num_prefill, block_table, token_table, last_sampled),
# (outputs: input_ids, positions, slot_mapping, seq_lens, logits_indices, block_tables_out)
ENGINE_DTYPES = ((torch.int32,) * 6 + (torch.int64,),
                 (torch.int64, torch.int64, torch.int64, torch.int32, torch.int64, torch.int32))
OTHER_DTYPES = ((torch.int64,) * 6 + (torch.int32,),
                (torch.int32, torch.int32, torch.int32, torch.int64, torch.int32, torch.int64))


@dataclass
class Entry:
    row: int  # request row in the per-request tables
    start: int  # position of the first new token
    q_len: int
    num_prefill: int  # prompt tokens known for the row (positions below it read token_table)


def make_step(entries, num_rows, max_model_len, block_size, pad, dtypes, device, seed=0) -> dict:
    """Keyword arguments of prepare_inputs for one step. pad: extra length of each output buffer
    (input_ids, positions, slot_mapping, seq_lens, logits_indices)."""
    gen = torch.Generator().manual_seed(seed)
    (idx_dt, qsl_dt, sp_dt, np_dt, bt_dt, tt_dt, ls_dt), (ids_dt, pos_dt, slot_dt, sl_dt, li_dt, bto_dt) = dtypes
    max_blocks = max_model_len // block_size
    num_pages = num_rows * max_blocks
    block_table = torch.randperm(num_pages, generator=gen)[:num_rows * max_blocks].view(num_rows, max_blocks)
    num_prefill = torch.randint(0, max_model_len, (num_rows,), generator=gen)
    for e in entries:
        num_prefill[e.row] = e.num_prefill
    num_reqs = len(entries)
    q_lens = torch.tensor([e.q_len for e in entries], dtype=torch.int64)
    qsl = torch.zeros(num_reqs + 1 + 2, dtype=torch.int64)  # longer than num_reqs + 1, like a persistent buffer
    qsl[1:num_reqs + 1] = torch.cumsum(q_lens, 0)
    num_tokens = int(q_lens.sum())
    idx = torch.zeros(num_reqs + 2, dtype=torch.int64)
    idx[:num_reqs] = torch.tensor([e.row for e in entries], dtype=torch.int64)
    start_pos = torch.zeros(num_reqs + 2, dtype=torch.int64)
    start_pos[:num_reqs] = torch.tensor([e.start for e in entries], dtype=torch.int64)
    pad_ids, pad_pos, pad_slot, pad_seq, pad_logits = pad
    poisoned = lambda n, dt: torch.full((n,), SENTINEL, dtype=dt)  # noqa: E731
    kw = dict(
        idx_mapping=idx.to(idx_dt), query_start_loc=qsl.to(qsl_dt), start_pos=start_pos.to(sp_dt),
        num_reqs=num_reqs, num_tokens=num_tokens,
        token_table=torch.randint(0, 50000, (num_rows, max_model_len), generator=gen).to(tt_dt),
        num_prefill=num_prefill.to(np_dt),
        last_sampled=torch.randint(0, 50000, (num_rows,), generator=gen).to(ls_dt),
        block_table=block_table.to(bt_dt), block_size=block_size,
        input_ids=poisoned(num_tokens + pad_ids, ids_dt), positions=poisoned(num_tokens + pad_pos, pos_dt),
        seq_lens=poisoned(num_reqs + pad_seq, sl_dt), slot_mapping=poisoned(num_tokens + pad_slot, slot_dt),
        logits_indices=poisoned(num_reqs + pad_logits, li_dt),
        block_tables_out=torch.full((num_reqs + max(pad_seq, 1), max_blocks), SENTINEL, dtype=bto_dt),
    )
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def run_both(kw: dict, triton_fn=prepare_inputs_triton) -> tuple[dict, dict]:
    """Runs the reference and the kernel on separate copies of the outputs; returns both sets."""
    ref = {k: (v.clone() if k in OUTPUTS else v) for k, v in kw.items()}
    out = {k: (v.clone() if k in OUTPUTS else v) for k, v in kw.items()}
    prepare_inputs_ref(**ref)
    triton_fn(**out)
    return ({k: ref[k] for k in OUTPUTS}, {k: out[k] for k in OUTPUTS})


def check_step(kw: dict, triton_fn=prepare_inputs_triton) -> None:
    ref, out = run_both(kw, triton_fn)
    for name in OUTPUTS:
        assert out[name].dtype == ref[name].dtype
        assert torch.equal(out[name], ref[name]), name
    n = kw["num_reqs"]
    for name in ("input_ids", "positions", "seq_lens", "slot_mapping", "logits_indices"):
        assert not (out[name] == SENTINEL).any(), f"{name}: unwritten elements"
    assert not (out["block_tables_out"][:n] == SENTINEL).any()
    assert (out["block_tables_out"][n:] == SENTINEL).all(), "padding rows of block_tables_out are left alone"


CPU_ENTRIES = [
    Entry(row=3, start=0, q_len=20, num_prefill=30),  # first prefill chunk
    Entry(row=0, start=20, q_len=10, num_prefill=30),  # last prefill chunk
    Entry(row=5, start=28, q_len=5, num_prefill=30),  # prompt tail, then sampled/draft positions
    Entry(row=1, start=40, q_len=1, num_prefill=30),  # decode
    Entry(row=6, start=63, q_len=1, num_prefill=10),  # decode at the last position
]


@pytest.mark.parametrize("dtypes", [ENGINE_DTYPES, OTHER_DTYPES], ids=["engine_dtypes", "other_dtypes"])
@pytest.mark.parametrize("device", DEVICES)
def test_prepare_inputs_mixed_batch(device, dtypes):
    kw = make_step(CPU_ENTRIES, num_rows=8, max_model_len=64, block_size=16, pad=(37, 1, 5, 3, 2),
                   dtypes=dtypes, device=device)
    check_step(kw)


@pytest.mark.parametrize("device", DEVICES)
def test_prepare_inputs_long_chunks_and_long_padding(device):
    """Requests longer than a token block, block-table rows longer than a copy block, and token
    padding longer than the whole grid covers in one stride."""
    entries = [Entry(row=2, start=0, q_len=300, num_prefill=400), Entry(row=0, start=500, q_len=1, num_prefill=20),
               Entry(row=1, start=130, q_len=129, num_prefill=200)]
    kw = make_step(entries, num_rows=3, max_model_len=512, block_size=1, pad=(5, 9000, 0, 1, 0),
                   dtypes=ENGINE_DTYPES, device=device, seed=1)
    check_step(kw)


@pytest.mark.parametrize("device", DEVICES)
def test_prepare_inputs_all_padding(device):
    kw = make_step([], num_rows=4, max_model_len=64, block_size=16, pad=(8, 8, 8, 4, 4),
                   dtypes=ENGINE_DTYPES, device=device)
    check_step(kw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prepare_inputs_real_shapes():
    gen = torch.Generator().manual_seed(2)
    rows = torch.randperm(512, generator=gen)[:256].tolist()
    entries = []
    for i, r in enumerate(rows):
        if i < 3:  # long prefill chunks
            entries.append(Entry(r, start=2048 * i, q_len=2048, num_prefill=8000))
        else:  # decodes at scattered positions
            pos = int(torch.randint(8000, 32767, (1,), generator=gen))
            entries.append(Entry(r, start=pos, q_len=1, num_prefill=8000))
    kw = make_step(entries, num_rows=512, max_model_len=32768, block_size=16, pad=(1900, 1900, 1900, 256, 256),
                   dtypes=ENGINE_DTYPES, device="cuda")
    check_step(kw, triton_fn=prepare_inputs)  # through the dispatcher, keyword arguments


def make_post_update(num_rows, num_reqs, vocab, device, seed=0, with_counts=True):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.full((num_reqs + 3,), 10**6, dtype=torch.int32)  # garbage past num_reqs must not be read
    idx[:num_reqs] = torch.randperm(num_rows, generator=gen)[:num_reqs].to(torch.int32)
    sampled = torch.full((num_reqs + 3,), -5, dtype=torch.int64)
    sampled[:num_reqs] = torch.randint(0, vocab, (num_reqs,), generator=gen)
    mask = torch.rand(num_reqs + 3, generator=gen) < 0.7
    last = torch.randint(0, vocab, (num_rows,), generator=gen)
    counts = torch.randint(0, 3, (num_rows, vocab), generator=gen, dtype=torch.int32) if with_counts else None
    return [t.to(device) if t is not None else None for t in (idx, sampled, mask, last, counts)]


@pytest.mark.parametrize("with_counts", [True, False])
@pytest.mark.parametrize("device", DEVICES)
def test_post_update(device, with_counts):
    shapes = (8, 5, 50) if device == "cpu" else (512, 256, 151936)
    for num_reqs in (shapes[1], 0):
        idx, sampled, mask, last, counts = make_post_update(*shapes[:1], num_reqs, shapes[2], device,
                                                            with_counts=with_counts)
        ref_last, ref_counts = last.clone(), counts.clone() if with_counts else None
        post_update_ref(idx, sampled, mask, num_reqs, ref_last, ref_counts)
        fn = post_update_triton if device == "cpu" else post_update  # the dispatcher on CUDA
        fn(idx, sampled, mask, num_reqs, last, counts)
        assert torch.equal(last, ref_last)
        if with_counts:
            assert torch.equal(counts, ref_counts)
