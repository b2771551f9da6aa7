"""Each sampling parameter does what it says, through the whole engine on the embedded model."""

import math

import pytest
import torch

from tests.engine.conftest import assert_no_leaks, chat_ids, make_llm
from tests.helpers import full_logits
from tokenmill.sampling_params import SamplingParams

QUESTION = "Name three animals that live in the ocean."


@pytest.fixture(scope="module")
def llm(smollm):
    llm = make_llm(smollm, num_kv_blocks=192)
    yield llm
    assert_no_leaks(llm)


@pytest.fixture(scope="module")
def prompt(llm):
    return chat_ids(llm, QUESTION)


@pytest.fixture(scope="module")
def greedy_reference(llm, prompt):
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    return out.outputs[0]


def gen(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0].outputs


def test_max_tokens(llm, prompt):
    out = gen(llm, prompt, temperature=0, max_tokens=5, ignore_eos=True)[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_stop_string_is_cut_and_not_returned(llm, prompt, greedy_reference):
    text = greedy_reference.text
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    out = gen(llm, prompt, temperature=0, max_tokens=40, ignore_eos=True, stop=[stop, "zzzz-never"])[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    assert stop not in out.text
    kept = gen(llm, prompt, temperature=0, max_tokens=40, ignore_eos=True, stop=stop,
               include_stop_str_in_output=True)[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_stop_token_ids(llm, prompt, greedy_reference):
    stop_token = greedy_reference.token_ids[6]
    out = gen(llm, prompt, temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_token])[0]
    first = greedy_reference.token_ids.index(stop_token)
    assert out.token_ids == greedy_reference.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_token


def test_eos_stops_unless_ignored(llm):
    prompt = llm.engine.tokenize(llm.render_chat([{"role": "user", "content": "Say just the word yes."}]),
                                 add_special_tokens=False)
    eos = llm.engine.loaded.eos_token_ids
    natural = gen(llm, prompt, temperature=0, max_tokens=40)[0]
    assert natural.finish_reason == "stop" and natural.token_ids[-1] in eos and natural.stop_reason is None
    assert len(natural.token_ids) < 40
    ignored = gen(llm, prompt, temperature=0, max_tokens=40, ignore_eos=True)[0]
    assert len(ignored.token_ids) == 40 and ignored.finish_reason == "length"
    assert ignored.token_ids[: len(natural.token_ids)] == natural.token_ids
    # min_tokens: EOS is masked until then, so the answer runs on past its natural end.
    longer = gen(llm, prompt, temperature=0, max_tokens=40, min_tokens=len(natural.token_ids) + 5)[0]
    assert len(longer.token_ids) >= len(natural.token_ids) + 5
    assert not any(t in eos for t in longer.token_ids[: len(natural.token_ids) + 5])


def test_n_samples_share_the_prompt_and_differ(llm, prompt):
    hits_before = llm.engine.kv.prefix_hits
    outs = gen(llm, prompt, temperature=1.0, max_tokens=12, ignore_eos=True, n=3, seed=7)
    assert [o.index for o in outs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in outs}) == 3
    # Samples 1 and 2 reuse the prompt's full blocks computed for sample 0.
    assert llm.engine.kv.prefix_hits - hits_before >= 2 * 16 * (len(prompt) // 16 - 1)
    again = gen(llm, prompt, temperature=1.0, max_tokens=12, ignore_eos=True, n=3, seed=7)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]


def test_cache_salt_keeps_prefix_cache_blocks_apart(llm, prompt):
    """Requests share cached prompt blocks only with requests of the same cache_salt (tenants)."""
    def cached(salt):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, cache_salt=salt), use_tqdm=False)[0]
        return out.metrics.num_cached_prompt_tokens

    full = 16 * ((len(prompt) - 1) // 16)  # the prompt's full blocks (its last token is always computed)
    cached(None)  # now the prompt is cached without a salt
    assert cached("tenant-a") == 0
    assert cached("tenant-a") == full
    assert cached("tenant-b") == 0
    assert cached(None) == full and cached("tenant-b") == full


def test_seeded_request_is_independent_of_its_batch(llm, prompt):
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, ignore_eos=True, seed=1234)
    alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [llm.engine.tokenize(llm.render_chat([{"role": "user", "content": q}]), add_special_tokens=False)
              for q in ("Hi!", "What is 7 times 6?", "Describe a cat.")]
    mixed = llm.generate(others[:2] + [prompt] + others[2:],
                         [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)] * 2 + [params]
                         + [SamplingParams(temperature=0.5, max_tokens=9, ignore_eos=True)], use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone
    different_seed = gen(llm, prompt, temperature=0.9, top_p=0.95, max_tokens=16, ignore_eos=True, seed=1235)[0]
    assert different_seed.token_ids != alone


def test_logit_bias(llm, prompt, greedy_reference):
    forced = gen(llm, prompt, temperature=0, max_tokens=6, ignore_eos=True, logit_bias={42: 100.0})[0]
    assert forced.token_ids == [42] * 6
    first = greedy_reference.token_ids[0]
    banned = gen(llm, prompt, temperature=0, max_tokens=3, ignore_eos=True, logit_bias={first: -100.0})[0]
    assert banned.token_ids[0] != first


def test_penalties_reduce_repetition(llm):
    prompt = llm.engine.tokenize("one two one two one two one two one two", add_special_tokens=False)
    plain = gen(llm, prompt, temperature=0, max_tokens=24, ignore_eos=True)[0].token_ids
    for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 3.0}):
        penalised = gen(llm, prompt, temperature=0, max_tokens=24, ignore_eos=True, **kw)[0].token_ids
        assert len(set(penalised)) > len(set(plain)), kw
    # repetition_penalty also counts prompt tokens: "one" and "two" become unlikely at once.
    rep = gen(llm, prompt, temperature=0, max_tokens=4, ignore_eos=True, repetition_penalty=10.0)[0].token_ids
    assert not set(rep) & set(prompt)


def test_penalty_arithmetic_on_fixed_logits():
    from tokenmill.kernels.sampling import apply_penalties_ref

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    counts = torch.tensor([[2, 0, 1, 0]], dtype=torch.int32)
    prompt_mask = torch.tensor([[False, True, False, False]])
    apply_penalties_ref(logits, counts, prompt_mask, torch.tensor([2.0]), torch.tensor([0.5]), torch.tensor([0.25]))
    expected = [2.0 / 2 - 0.5 * 2 - 0.25, -1.0 * 2, 0.5 / 2 - 0.5 - 0.25, 3.0]
    assert torch.allclose(logits[0], torch.tensor(expected))


def test_logprobs_match_the_model(llm, prompt, smollm):
    out = gen(llm, prompt, temperature=0, max_tokens=4, ignore_eos=True, logprobs=5)[0]
    assert len(out.logprobs) == 4
    logits = full_logits(smollm.model, [prompt + out.token_ids])[0]
    ref = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + 3], dim=-1)
    total = 0.0
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert token in entry and entry[token].rank == 1  # greedy picks the top token
        assert len(entry) == 5  # the sampled token is the top one, so 5 entries in all
        top = torch.topk(ref[i], 5)
        assert list(entry.keys()) == top.indices.tolist()
        for tid, lp in entry.items():
            assert math.isclose(lp.logprob, ref[i, tid].item(), abs_tol=1e-4)
        assert entry[token].decoded_token == llm.tokenizer.decode([token])
        total += entry[token].logprob
    assert math.isclose(out.cumulative_logprob, total, rel_tol=1e-6)


def test_sampled_token_logprob_and_rank(llm, prompt):
    out = gen(llm, prompt, temperature=1.5, max_tokens=8, ignore_eos=True, logprobs=0, seed=3)[0]
    assert all(len(e) >= 1 and out.token_ids[i] in e for i, e in enumerate(out.logprobs))
    ranks = [e[t].rank for e, t in zip(out.logprobs, out.token_ids)]
    assert all(r >= 1 for r in ranks) and any(r > 1 for r in ranks)  # hot sampling leaves the argmax sometimes


def test_abort_frees_everything(llm, prompt):
    engine = llm.engine
    engine.add_request(None, SamplingParams(max_tokens=30, ignore_eos=True), request_id="to-abort", prompt_ids=prompt)
    engine.add_request(None, SamplingParams(max_tokens=5, ignore_eos=True), request_id="keep", prompt_ids=prompt)
    for _ in range(3):
        engine.step()
    aborted = engine.abort_request("to-abort")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    assert "to-abort" not in done and len(done["keep"].outputs[0].token_ids) == 5
    assert_no_leaks(llm)
