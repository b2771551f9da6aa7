"""The sampler's grammar stage: the engine's packed masks reach the rows that have a grammar (also
when a request owns several logits rows), rows without one are untouched, and a row's next owner
without a grammar does not inherit its mask."""

import numpy as np
import torch

from tokenmill.step_io import NewRequestData
from tokenmill.runner.sample import Sampler
from tokenmill.sampling_params import SamplingParams

VOCAB = 70  # 3 words a row
DEV = torch.device("cpu")


def _new(row_id: str, grammar: bool) -> NewRequestData:
    params = SamplingParams(temperature=0.0, structured_outputs={"regex": "a"} if grammar else None)
    return NewRequestData(row_id, [1, 2], 2, params, 0, [0])


def _mask_allowing(tokens) -> np.ndarray:
    mask = np.zeros(3, dtype=np.uint32)
    for t in tokens:
        mask[t // 32] |= np.uint32(1 << (t % 32))
    return mask.view(np.int32)


def test_masks_apply_to_grammar_rows_only():
    sampler = Sampler(4, VOCAB, DEV)
    sampler.add_request(0, _new("a", True))
    sampler.add_request(1, _new("b", False))
    sampler.apply_staged()
    assert not sampler.grammar.needed(np.array([1]))
    assert sampler.grammar.needed(np.array([0, 1]))
    sampler.grammar.set_masks(np.array([0]), _mask_allowing([5, 40, 69])[None])
    logits = torch.randn(3, VOCAB)
    logits[:, 7] = 100.0  # the unconstrained argmax
    rows = np.array([0, 1, 0])  # row 0 twice, as a speculative step lays out a request's rows
    out = sampler(logits, rows, torch.tensor(rows), torch.tensor([2, 2, 3]))
    allowed = {5, 40, 69}
    assert int(out.sampled[0]) in allowed and int(out.sampled[2]) in allowed
    assert int(out.sampled[1]) == 7
    processed = sampler.process(logits, rows, torch.tensor(rows), torch.tensor([2, 2, 3]))
    assert torch.isinf(processed.logits[0]).sum() == VOCAB - 3
    assert torch.equal(processed.logits[1], logits[1])


def test_no_grammar_costs_nothing_and_rows_are_reset():
    sampler = Sampler(2, VOCAB, DEV)
    sampler.add_request(0, _new("a", True))
    sampler.apply_staged()
    sampler.grammar.set_masks(np.array([0]), _mask_allowing([3])[None])
    sampler.remove_request(0)
    sampler.add_request(0, _new("b", False))  # the row's next owner has no grammar
    sampler.apply_staged()
    assert not sampler.grammar.needed(np.array([0, 1]))
    assert bool((sampler.grammar.table[0] == -1).all())
    logits = torch.randn(1, VOCAB)
    processed = sampler.process(logits, np.array([0]), torch.tensor([0]), torch.tensor([2]))
    assert processed.logits is logits  # no stage ran: not even a float32 copy
