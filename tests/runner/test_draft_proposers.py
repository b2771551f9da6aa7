"""The draft-model and layer-truncated proposers on their own (tiny-llama, CPU): which KV slots their
draft steps write (only those below an entry's slot limit, only for entries whose drafts will be
verified, only the draft's layers), the draft model's replay of the step into its own cache, the
padded batches a CUDA graph replays (same drafts, padding writes nothing), and what they refuse."""

import pytest
import torch

from tokenmill.config import ConfigError
from tokenmill.layers.forward_context import AttentionMetadata
from tokenmill.loader import load_model
from tokenmill.step_io import NewRequestData
from tokenmill.runner.kv_cache import KVCacheSpec, allocate_kv_cache
from tokenmill.runner.request_states import RequestStates
from tokenmill.runner.spec_decode import ProposerInputs
from tokenmill.runner.spec_decode.draft_model import DraftModelProposer
from tokenmill.runner.spec_decode.layer_truncated import LayerTruncatedProposer
from tokenmill.sampling_params import SamplingParams

from tests.runner.common import CPU

BS, NUM_BLOCKS, MAX_LEN, K = 4, 16, 32, 3
SENTINEL = 1e4
# request: (prompt length, its blocks); its row holds 8 slots (two blocks)
ROWS = {"a": (6, [3, 7]), "b": (7, [5, 9]), "c": (5, [11, 12])}


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama", load_format="dummy", dtype="float32", device="cpu", max_positions=MAX_LEN)


def admit() -> RequestStates:
    states = RequestStates(max_num_reqs=4, max_model_len=MAX_LEN, block_size=BS, device=CPU)
    for i, (req_id, (n, blocks)) in enumerate(ROWS.items()):
        prompt = [(7 * i + 3 * j + 1) % 1000 for j in range(n)]
        states.add(NewRequestData(req_id, prompt, n, SamplingParams(), 0, list(blocks)))
    states.apply_staged()
    return states


def proposer_and_caches(kind: str, tiny):
    model = tiny.model
    if kind == "draft_model":
        proposer = DraftModelProposer(model, tiny.arch.vocab_size, K, 4, MAX_LEN, BS, CPU)
        proposer.bind_kv_cache(NUM_BLOCKS, None)
        caches = proposer.kv_caches
    else:
        spec = model.attention_spec()
        caches = allocate_kv_cache(KVCacheSpec(spec.num_layers, spec.num_kv_heads, spec.head_dim, BS, spec.dtype),
                                   NUM_BLOCKS, CPU)
        proposer = LayerTruncatedProposer(model, 1, K, 4, MAX_LEN, BS, CPU)
        proposer.bind_kv_cache(NUM_BLOCKS, caches)
    for k_cache, v_cache in caches:
        k_cache.fill_(SENTINEL)
        v_cache.fill_(SENTINEL)
    return proposer, caches


def written(caches) -> dict[int, set[tuple[int, int]]]:
    """Per layer, the (block, offset) slots whose K and V no longer hold the sentinel."""
    out = {}
    for layer, (k_cache, v_cache) in enumerate(caches):
        k_changed = (k_cache != SENTINEL).flatten(2).any(-1)
        assert torch.equal(k_changed, (v_cache != SENTINEL).flatten(2).any(-1))
        out[layer] = {(int(b), int(o)) for b, o in k_changed.nonzero().tolist()}
    return out


def slot_of(req_id: str, position: int) -> tuple[int, int]:
    return ROWS[req_id][1][position // BS], position % BS


def batch(states: RequestStates, order=("a", "b", "c")) -> torch.Tensor:
    return torch.tensor([states.row_of[r] for r in order] + [0], dtype=torch.int64)  # one padding entry


@pytest.mark.parametrize("kind", ["draft_model", "layer_truncated"])
def test_draft_steps_write_only_reserved_slots_of_drafting_entries(kind, tiny):
    states = admit()
    proposer, caches = proposer_and_caches(kind, tiny)
    idx = batch(states)
    slot_limit = torch.tensor([8, 7, 8])  # b holds one slot fewer than its blocks
    draft_mask = torch.tensor([True, True, False])  # c's drafts would not be verified
    drafts = proposer.propose(ProposerInputs(
        idx, 3, states.token_table.gpu, states.num_prefill_gpu, K, block_table=states.block_table.gpu,
        block_size=BS, slot_limit=slot_limit, draft_mask=draft_mask, **replay_of_a(states, kind)))
    assert drafts.draft_ids.shape == (3, K) and drafts.num_drafts.tolist() == [K] * 3
    assert ((0 <= drafts.draft_ids) & (drafts.draft_ids < tiny.arch.vocab_size)).all()
    # Draft step j feeds position known - 1 + j: a (6 known) positions 5, 6, 7; b (7 known) 6 only
    # (its limit is 7); c nothing.
    expected = {slot_of("a", p) for p in (5, 6, 7)} | {slot_of("b", 6)}
    if kind == "draft_model":  # the replay of a's step (its prefill, positions 0..5) writes too
        expected |= {slot_of("a", p) for p in range(6)}
        assert written(caches) == {0: expected, 1: expected}
    else:  # only the draft's layer, in the target's cache
        assert written(caches) == {0: expected, 1: set()}


def replay_of_a(states: RequestStates, kind: str) -> dict:
    """The step the target just ran, for the draft model to replay: a's prefill of 6 tokens."""
    if kind != "draft_model":
        return {}
    row = states.row_of["a"]
    positions = torch.arange(6)
    slots = torch.tensor([b * BS + o for b, o in (slot_of("a", p) for p in range(6))])
    meta = AttentionMetadata(torch.tensor([0, 6], dtype=torch.int32), torch.tensor([6], dtype=torch.int32),
                             states.block_table.gpu[row:row + 1], slots, max_query_len=6, max_seq_len=6)
    return dict(input_ids=states.token_table.gpu[row, :6].long(), positions=positions, attn_metadata=meta)


@pytest.mark.parametrize("kind", ["draft_model", "layer_truncated"])
def test_padded_batch_as_a_graph_replays_it(kind, tiny):
    """A CUDA graph replays the k steps for a padded batch size: the same drafts as the unpadded
    batch, and the padding entries write nothing (run eagerly here, through the same code)."""
    states = admit()
    args = (states.token_table.gpu, states.num_prefill_gpu, states.block_table.gpu, torch.tensor([8, 8, 8]),
            torch.tensor([True, True, True]))
    proposer, caches = proposer_and_caches(kind, tiny)
    loop = proposer.loop
    plain = loop.run(batch(states), 3, *args).draft_ids.clone()
    before = written(caches)
    for k_cache, v_cache in caches:
        k_cache.fill_(SENTINEL)
        v_cache.fill_(SENTINEL)
    loop._load(batch(states), 3, 8, *args)  # what run() does before replaying the graph of size 8
    loop._steps(8)
    assert torch.equal(loop._drafts[:3], plain)
    assert written(caches) == before


def test_what_the_proposers_refuse(tiny):
    with pytest.raises(ConfigError, match="the draft model's vocabulary has 1024 tokens but the target's has 49152"):
        DraftModelProposer(tiny.model, 49152, K, 4, MAX_LEN, BS, CPU)
    for n in (0, 2):
        with pytest.raises(ConfigError, match=rf"num_draft_layers must be in 1\.\.1 \(the target has 2 decoder "
                                              rf"layers.*got {n}"):
            LayerTruncatedProposer(tiny.model, n, K, 4, MAX_LEN, BS, CPU)


def test_truncated_forward_is_the_first_layers(tiny):
    """forward_first_layers(n): the embedding, the first n decoder layers, the final norm."""
    from tokenmill.layers.forward_context import forward_context

    model = tiny.model
    spec = model.attention_spec()
    caches = allocate_kv_cache(KVCacheSpec(spec.num_layers, spec.num_kv_heads, spec.head_dim, BS, spec.dtype),
                               NUM_BLOCKS, CPU)
    ids, pos = torch.tensor([5, 9, 11, 2]), torch.arange(4)
    meta = AttentionMetadata(torch.tensor([0, 4], dtype=torch.int32), torch.tensor([4], dtype=torch.int32),
                             torch.tensor([[1, 2]], dtype=torch.int32), torch.arange(4) + BS, max_query_len=4,
                             max_seq_len=4)
    with torch.inference_mode(), forward_context(meta, caches):
        hidden, residual = model.model.layers[0](pos, model.model.embed_tokens(ids), None)
        expected, _ = model.model.norm(hidden, residual)
        assert torch.equal(model.forward_first_layers(ids, pos, 1), expected)
        assert torch.equal(model.forward_first_layers(ids, pos, 2), model(ids, pos))
        with pytest.raises(ValueError, match="num_layers must be in 1..2"):
            model.forward_first_layers(ids, pos, 3)
