"""bad_words and allowed_token_ids through the whole engine on the embedded model (greedy fp32 on
the CPU): a banned word's tokens never appear in the output, whose tokens before the first banned
point are the unconstrained run's; allowed_token_ids keeps every token in the set. With async
scheduling on and off, chunked prefill, n = 2 and beside unconstrained requests."""

import pytest

from tests.engine.conftest import assert_no_leaks, chat_ids, make_llm
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams

QUESTION = "Name three animals that live in the ocean."
LONG = ("The ocean covers most of the planet and holds a great many creatures, from tiny plankton to whales. "
        "Some live near the surface where the light reaches, others in the deep where it never does. ") * 2
GREEDY = dict(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(smollm):
    llm = make_llm(smollm, num_kv_blocks=64)
    yield llm
    assert_no_leaks(llm)


@pytest.fixture(scope="module")
def prompt(llm):
    return chat_ids(llm, QUESTION)


def gen(llm, prompts, **kw):
    return [o.outputs for o in llm.generate(prompts, SamplingParams(**kw), use_tqdm=False)]


def word_of(llm, tokens: list[int], length: int) -> str:
    """A word the output holds: `length` tokens of it whose text tokenizes back to them, alone or
    after a space (bad_words' two spellings)."""
    tok = llm.tokenizer
    for i in range(len(tokens) - length + 1):
        piece = tokens[i:i + length]
        text = tok.decode(piece)
        if text.strip() and piece in (tok.encode(text, add_special_tokens=False),
                                      tok.encode(" " + text.lstrip(), add_special_tokens=False)):
            return text
    raise AssertionError(f"no {length}-token word in {tokens}")


def first_ban(sequences: list[list[int]], prompt: list[int], output: list[int]) -> int:
    """The index of the first output token some sequence would ban (len(output) if none)."""
    full = prompt + output
    for j in range(len(output)):
        end = len(prompt) + j + 1
        if any(len(s) <= end and full[end - len(s):end] == s for s in sequences):
            return j
    return len(output)


def check_banned(llm, prompt: list[int], reference: list[int], output: list[int], words: list[str]) -> None:
    params = SamplingParams(bad_words=words)
    params.resolve_bad_words(llm.tokenizer)
    j = first_ban(params.bad_words_token_ids, prompt, reference)
    assert j < len(reference), "the reference holds the word"
    assert output[:j] == reference[:j] and output[j] != reference[j]
    assert first_ban(params.bad_words_token_ids, prompt, output) == len(output), "no output token ends a word"


@pytest.fixture(scope="module")
def other(llm):
    return llm.engine.tokenize("Describe a cat.", add_special_tokens=False)


@pytest.fixture(scope="module")
def references(llm, prompt, other):
    """The unconstrained greedy outputs of both prompts."""
    return [o[0].token_ids for o in gen(llm, [prompt, other], **GREEDY)]


def test_bad_words_are_never_generated(llm, prompt, other, references):
    reference = references[0]
    one, two = word_of(llm, reference, 1), word_of(llm, reference, 2)
    # A word of one token, one of two, beside an unconstrained request that keeps its own tokens.
    outs = llm.generate([prompt, prompt, other], [SamplingParams(bad_words=[one], **GREEDY),
                                                  SamplingParams(bad_words=["zebra fish", two], **GREEDY),
                                                  SamplingParams(**GREEDY)], use_tqdm=False)
    check_banned(llm, prompt, reference, outs[0].outputs[0].token_ids, [one])
    check_banned(llm, prompt, reference, outs[1].outputs[0].token_ids, ["zebra fish", two])
    assert outs[2].outputs[0].token_ids == references[1]


def test_allowed_token_ids(llm, prompt, references):
    reference = references[0]
    allowed = sorted(set(reference[2:]) - {reference[0]}) + [11, 12]
    outs = llm.generate([prompt, prompt], [
        SamplingParams(allowed_token_ids=allowed, **GREEDY),
        SamplingParams(allowed_token_ids=allowed, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)],
        use_tqdm=False)
    greedy, sampled = (o.outputs[0].token_ids for o in outs)
    assert len(greedy) == len(sampled) == 12 and greedy[0] != reference[0]
    assert set(greedy) <= set(allowed) and set(sampled) <= set(allowed)


def test_n_samples_each_avoid_the_word(llm, prompt):
    kw = dict(n=2, temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)
    reference = [o.token_ids for o in gen(llm, [prompt], **kw)[0]]
    word = word_of(llm, reference[0], 2)
    outs = [o.token_ids for o in gen(llm, [prompt], bad_words=[word], **kw)[0]]
    check_banned(llm, prompt, reference[0], outs[0], [word])
    params = SamplingParams(bad_words=[word])
    params.resolve_bad_words(llm.tokenizer)
    assert first_ban(params.bad_words_token_ids, prompt, outs[1]) == len(outs[1])
    j = first_ban(params.bad_words_token_ids, prompt, reference[1])
    assert outs[1][:j] == reference[1][:j]


def test_without_async_scheduling(smollm, prompt, references):
    llm = make_llm(smollm, num_kv_blocks=64, async_scheduling=False)
    reference = references[0]  # greedy tokens do not depend on the scheduling
    word = word_of(llm, reference, 2)
    check_banned(llm, prompt, reference, gen(llm, [prompt], bad_words=[word], **GREEDY)[0][0].token_ids, [word])
    assert_no_leaks(llm)


def test_chunked_prefill(smollm):
    llm = make_llm(smollm, num_kv_blocks=64, max_num_batched_tokens=32)
    prompt = llm.engine.tokenize(llm.render_chat([{"role": "user", "content": LONG + QUESTION}]),
                                 add_special_tokens=False)
    assert len(prompt) > 3 * 32
    reference = gen(llm, [prompt], **GREEDY)[0][0].token_ids
    word = word_of(llm, reference, 2)
    check_banned(llm, prompt, reference, gen(llm, [prompt], bad_words=[word], **GREEDY)[0][0].token_ids, [word])
    assert_no_leaks(llm)


def test_preemption(smollm, llm, prompt, references):
    """Rows preempted and resumed (their history rebuilt from prompt + outputs) ban as before."""
    word = word_of(llm, references[0], 2)
    params = SamplingParams(bad_words=[word], **GREEDY)
    want = gen(llm, [prompt], bad_words=[word], **GREEDY)[0][0].token_ids
    small = make_llm(smollm, num_kv_blocks=10, enable_prefix_caching=False)
    outs = small.generate([prompt] * 4, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert all(o.outputs[0].token_ids == want for o in outs)
    assert_no_leaks(small)


@pytest.mark.parametrize("kw, match", [
    ({"allowed_token_ids": []}, "must not be empty"),
    ({"allowed_token_ids": [5, 10**9]}, "outside the vocabulary"),  # only the engine knows the vocabulary
    ({"bad_words": ["ocean", ""]}, "non-empty strings"),
])
def test_bad_input(llm, prompt, kw, match):
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate([prompt], SamplingParams(max_tokens=2, **kw), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
