"""The allowed_token_ids / bad_words stage on its own (CPU): its rows, needed(), the masks against
torch references, and the device history of words of several tokens followed step by step as the
runner drives it (post-update writing last_sampled between steps, prefill chunks, resumed rows)."""

import numpy as np
import pytest
import torch

from tokenmill.errors import InvalidRequestError
from tokenmill.kernels.token_mask import NO_TOKEN, WILDCARD, apply_bad_words_ref, ban_bad_words, ban_bad_words_ref
from tokenmill.runner.sample.sampler import Sampler
from tokenmill.runner.sample.token_mask import TokenMaskStage
from tokenmill.sampling_params import SamplingParams
from tests.kernels.common import DEVICES
from tests.runner.common import CPU, V, batch, new_request, random_logits

NEG = float("-inf")


def words_params(*words: list[int], **kw) -> SamplingParams:
    """Parameters whose bad words are already token ids (resolve_bad_words needs a tokenizer)."""
    params = SamplingParams(bad_words=["w"] * len(words), **kw)
    params.bad_words_token_ids = [list(w) for w in words]
    return params


def stage_with_history(rows: int = 4) -> tuple[TokenMaskStage, torch.Tensor]:
    stage = TokenMaskStage(rows, V, CPU)
    last_sampled = torch.zeros(rows, dtype=torch.int64)
    stage.bind_last_sampled(last_sampled)
    return stage, last_sampled


def banned(logits: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(row == NEG).flatten().tolist() for row in logits]


def test_ban_bad_words_matches_the_reference():
    gen = torch.Generator().manual_seed(3)
    b, s, length = 6, 9, 4
    history = torch.randint(0, 4, (b, length), generator=gen)
    history[0, :2] = NO_TOKEN  # a short sequence
    prefix = torch.randint(0, 4, (b, s, length), generator=gen)
    for row in range(b):  # right-aligned words of 1 ... length + 1 tokens
        for w in range(s):
            prefix[row, w, : int(torch.randint(0, length + 1, (1,), generator=gen))] = WILDCARD
    prefix[1] = history[1]  # words that surely match row 1's last tokens
    prefix[1, :4, :2] = WILDCARD  # (shorter ones too)
    last = torch.randint(0, V, (b, s), generator=gen)
    last[2, 3:] = -1  # padding
    last[3, :] = 7  # one token banned by some words and not by others
    logits = random_logits(b)
    want = logits.clone()
    ban_bad_words_ref(want, history, prefix, last)
    ban_bad_words(logits, history, prefix, last)
    assert torch.equal(logits, want)
    assert banned(logits)[1] == sorted(set(last[1].tolist())), "matching words ban their last tokens"
    assert 0 < sum(len(r) for r in banned(logits)) < b * s


def random_tables(gen: torch.Generator, rows: int = 6, words: int = 12, width: int = 5, ring: int = 8):
    prefix = torch.randint(0, 3, (rows, words, width), generator=gen, dtype=torch.int32)
    for r in range(rows):
        for w in range(words):
            prefix[r, w, : int(torch.randint(0, width + 1, (1,), generator=gen))] = WILDCARD
    last = torch.randint(0, V, (rows, words), generator=gen, dtype=torch.int32)
    last[0, 5:] = -1
    return prefix, last, torch.randint(0, 3, (rows, ring), generator=gen, dtype=torch.int32)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_words_kernel_matches_the_reference(device):
    """The Triton kernel (interpreted on the CPU) against the torch ops: the ring's update and the bans,
    over tracked rows (fresh token or not, short sequences), untracked rows and a row seen twice."""
    from tokenmill.kernels.token_mask_triton import apply_bad_words_triton

    gen = torch.Generator().manual_seed(5)
    prefix, last, ring = random_tables(gen)
    known = torch.tensor([3, 2**62, 10, 4, 2**62, 1])
    last_sampled = torch.randint(0, 3, (6,), generator=gen)
    idx = torch.tensor([0, 1, 2, 3, 4, 5, 1])
    positions = torch.tensor([4, 9, 7, 12, 3, 2, 10], dtype=torch.int32)  # rows 0, 3, 5 take last_sampled
    for count, length in ((12, 5), (7, 3), (12, 0)):
        logits = random_logits(len(idx))
        want, want_ring = logits.clone(), ring.clone()
        apply_bad_words_ref(want, idx, positions, known, last_sampled, want_ring, prefix, last, count, length)
        got, got_ring = logits.to(device), ring.to(device)
        apply_bad_words_triton(got, idx.to(device), positions.to(device), known.to(device), last_sampled.to(device),
                               got_ring if length else None, prefix.to(device), last.to(device), count, length)
        assert torch.equal(got.cpu(), want) and torch.equal(got_ring.cpu(), want_ring), (count, length)
        assert (want == NEG).any()


def test_allowed_token_ids_and_one_token_words():
    stage = TokenMaskStage(4, V, CPU)
    stage.add_request(0, new_request("allowed", SamplingParams(allowed_token_ids=[1, 33, 63, 33])))
    stage.add_request(1, new_request("plain", SamplingParams()))
    stage.add_request(2, new_request("words", words_params([5], [9])))
    assert stage.prefix_len[2] == 0 and stage.history is None, "words of one token keep no history"
    assert not stage.needed(np.array([1])) and stage.needed(np.array([1, 0])) and stage.needed(np.array([2]))
    stage.apply_staged()
    logits = random_logits(4)
    want = logits.clone()
    want[0, [t for t in range(V) if t not in (1, 33, 63)]] = NEG
    want[2, [5, 9]] = NEG
    want[3, [5, 9]] = NEG  # a second logits row of the same request (a verify step's)
    stage.apply(logits, batch([0, 1, 2, 2], [3, 3, 3, 4]))
    assert torch.equal(logits, want)


def test_nothing_exists_for_requests_without_the_features():
    stage = TokenMaskStage(4, V, CPU)
    stage.add_request(0, new_request("plain", SamplingParams()))
    stage.apply_staged()
    assert not stage.needed(np.array([0]))
    assert all(t is None for t in (stage.allowed, stage.prefix, stage.last, stage.history))


def test_a_row_reused_without_the_features_is_clean():
    stage, _ = stage_with_history()
    stage.add_request(0, new_request("a", words_params([5], [6, 7], allowed_token_ids=[5, 7, 8])))
    stage.add_request(1, new_request("b", words_params([9])))
    stage.apply_staged()
    stage.remove_request(0)
    stage.add_request(0, new_request("c", SamplingParams()))  # row 0 again, with neither feature
    stage.apply_staged()
    assert stage.needed(np.array([0, 1])) and not stage.needed(np.array([0]))
    logits = random_logits(2)
    want = logits.clone()
    want[1, 9] = NEG
    stage.apply(logits, batch([0, 1], [3, 3]))
    assert torch.equal(logits, want)


def run_steps(stage: TokenMaskStage, last_sampled: torch.Tensor, row: int, known: list[int],
              words: list[list[int]], steps: list[tuple[int, bool]], chosen: list[int]) -> None:
    """Drive one row as the runner does: each step applies the stage at `position` (the sampled
    token's), then, if the step samples, the post-update writes the chosen token to last_sampled.
    Checks every sampling step's bans against the full sequence."""
    sequence = list(known)
    picks = iter(chosen)
    for position, samples in steps:
        logits = random_logits(1, seed=position)
        stage.apply(logits, batch([row], [position]))
        if not samples:
            continue
        assert position == len(sequence)
        want = {w[-1] for w in words if len(sequence) >= len(w) - 1 and sequence[len(sequence) - len(w) + 1:] == w[:-1]}
        assert set(banned(logits)[0]) == want, (position, sequence)
        token = next(picks)
        sequence.append(token)
        last_sampled[row] = token


def test_words_of_several_tokens_follow_the_sampled_tokens():
    stage, last_sampled = stage_with_history()
    words = [[1, 2, 3], [2, 4], [7], [1, 2, 3, 4, 5, 6, 8]]
    prompt = (9, 1)
    stage.add_request(2, new_request("r", words_params(*words), prompt=prompt))
    stage.apply_staged()
    # 1 2 -> ban 3; 2 -> ban 4; then a long word typed out to its last token, across the ring's wrap.
    chosen = [2, 3, 1, 2, 3, 4, 5, 6, 9, 2, 5, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 0]
    steps = [(p, True) for p in range(len(prompt), len(prompt) + len(chosen))]
    run_steps(stage, last_sampled, 2, list(prompt), words, steps, chosen)


def test_chunked_prefill_and_a_resumed_request():
    stage, last_sampled = stage_with_history()
    words = [[5, 6, 7], [6, 8]]
    # Resumed after preemption: prompt (1, 5) plus earlier outputs (6, 2, 5, 6), known at admission.
    known = [1, 5, 6, 2, 5, 6]
    stage.add_request(1, new_request("r", words_params(*words), prompt=(1, 5), outputs=(6, 2, 5, 6)))
    stage.add_request(0, new_request("plain", SamplingParams()))
    stage.apply_staged()
    last_sampled[1] = 42  # a stale value of the row's last owner: must never be read
    # Two prefill chunks that do not sample (positions below the known count), then decodes.
    steps = [(3, False), (5, False)] + [(p, True) for p in range(6, 12)]
    run_steps(stage, last_sampled, 1, known, words, steps, [8, 5, 6, 7, 6, 3])
    # A plain row in a batch with the tracked one is untouched.
    logits = random_logits(2)
    want = logits.clone()
    stage.apply(logits, batch([0, 1], [7, 12]))
    assert torch.equal(logits[0], want[0])


def test_n_rows_of_one_prompt_keep_their_own_history():
    stage, last_sampled = stage_with_history()
    words = [[3, 4]]
    for row in (0, 1):
        stage.add_request(row, new_request(f"s{row}", words_params(*words), prompt=(1, 2)))
    stage.apply_staged()
    for position, tokens in ((2, (3, 5)), (3, (4, 3)), (4, (3, 3))):
        logits = random_logits(2, seed=position)
        stage.apply(logits, batch([0, 1], [position, position]))
        last_sampled[torch.tensor([0, 1])] = torch.tensor(tokens)
        if position == 3:
            assert banned(logits) == [[4], []]
        if position == 4:
            assert banned(logits) == [[], [4]]


def test_multi_token_words_need_the_runner_binding():
    stage = TokenMaskStage(4, V, CPU)
    with pytest.raises(RuntimeError, match="bind_last_sampled"):
        stage.add_request(0, new_request("r", words_params([1, 2])))


def test_the_sampler_runs_the_stage_after_the_grammar_mask():
    sampler = Sampler(4, V, CPU)
    assert sampler.stages.index(sampler.token_mask) == sampler.stages.index(sampler.grammar) + 1
    sampler.bind_last_sampled(torch.zeros(4, dtype=torch.int64))
    sampler.add_request(0, new_request("r", SamplingParams(temperature=0, allowed_token_ids=[11])))
    sampler.apply_staged()
    out = sampler(random_logits(1), np.array([0]), torch.tensor([0]), torch.tensor([3]))
    assert out.sampled.tolist() == [11]


class FakeTokenizer:
    """Words to ids: one token per character, a leading space its own token (id 0)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        return [0 if c == " " else ord(c) - ord("a") + 1 for c in text]


def test_resolve_bad_words():
    params = SamplingParams(bad_words=["ab", " ab", "c"])
    params.resolve_bad_words(FakeTokenizer())
    assert params.bad_words_token_ids == [[1, 2], [0, 1, 2], [3], [0, 3]]
    assert params.multi_token_bad_words
    params.validate()
    params.resolve_bad_words(FakeTokenizer())  # idempotent
    assert params.bad_words_token_ids == [[1, 2], [0, 1, 2], [3], [0, 3]]
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        SamplingParams(bad_words=["x"]).resolve_bad_words(None)
    SamplingParams().resolve_bad_words(None)  # no bad words, no tokenizer needed
    with pytest.raises(InvalidRequestError, match="at most 16"):
        SamplingParams(bad_words=["a" * 17]).resolve_bad_words(FakeTokenizer())


@pytest.mark.parametrize("kw, match", [
    ({"allowed_token_ids": []}, "must not be empty"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
    ({"allowed_token_ids": [1.5]}, "allowed_token_ids"),
    ({"bad_words": [""]}, "non-empty strings"),
    ({"bad_words": "word"}, "list of non-empty strings"),
    ({"bad_words": ["w"] * 101}, "at most 100"),
])
def test_bad_parameters(kw, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kw)


def test_allowed_token_ids_must_be_in_the_vocabulary():
    SamplingParams(allowed_token_ids=[0, 63]).check_vocab(64)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        SamplingParams(allowed_token_ids=[0, 64]).check_vocab(64)
    with pytest.raises(InvalidRequestError, match="more than"):
        SamplingParams(allowed_token_ids=[0] * 65).check_vocab(64)
