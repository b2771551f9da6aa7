"""Prompt logprobs (SamplingParams.prompt_logprobs) against HF transformers' log-softmax of its own
logits for the same prompt: plain, chunked prefill at small budgets, the prefix cache with a shared
prefix, preemption, n > 1; no KV block or row left behind."""

import pytest
import torch

from tests.engine.conftest import CHAT_PROMPTS, assert_no_leaks, make_llm
from tokenmill.errors import InvalidRequestError
from tokenmill.runner.prompt_logprobs import PromptLogprobsComputer
from tokenmill.sampling_params import SamplingParams

K = 3
SHARED = ("The quick brown fox jumps over the lazy dog. " * 6).strip()


@pytest.fixture(scope="module")
def prompts(smollm):
    tok = smollm.tokenizer
    texts = CHAT_PROMPTS[:4] + [SHARED + " Then it ran away.", SHARED + " Then it slept."]
    return [tok(t)["input_ids"] for t in texts]


@pytest.fixture(scope="module")
def hf_logprobs(hf_smollm, prompts):
    """log_softmax of HF's logits at every prompt position, float32 [len, vocab]."""
    out = []
    for ids in prompts:
        with torch.no_grad():
            logits = hf_smollm(torch.tensor([ids])).logits[0].float()
        out.append(torch.log_softmax(logits, dim=-1))
    return out


def check(outputs, prompts, hf_logprobs, k=K):
    for out, ids, ref in zip(outputs, prompts, hf_logprobs):
        lp = out.prompt_logprobs
        assert lp is not None and len(lp) == len(ids) and lp[0] is None
        for i in range(1, len(ids)):
            entry, row = lp[i], ref[i - 1]
            token = ids[i]
            assert token in entry
            assert abs(entry[token].logprob - row[token].item()) < 1e-4, (i, entry[token].logprob, row[token].item())
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            top = torch.topk(row, k)
            tops = {t: v for t, v in entry.items() if v.rank <= k}
            for rank, (value, tid) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
                got = entry.get(tid)
                assert got is not None and abs(got.logprob - value) < 1e-4
            assert len(entry) in (k, k + 1) and len(tops) >= k - 1
        for c in out.outputs:
            assert len(c.token_ids) == 2


REGIMES = {
    "default": dict(),
    "chunked-7": dict(max_num_batched_tokens=7),
    "chunked-16-sync": dict(max_num_batched_tokens=16, async_scheduling=False),
    "preemption": dict(num_kv_blocks=6, max_num_batched_tokens=32),
}


@pytest.mark.parametrize("regime", list(REGIMES))
def test_prompt_logprobs_match_hf(smollm, prompts, hf_logprobs, regime):
    llm = make_llm(smollm, **REGIMES[regime])
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=K)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    check(outputs, prompts, hf_logprobs)
    if regime == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leaks(llm)


def test_prefix_cache_shared_prefix(smollm, prompts, hf_logprobs):
    """Two requests with a long shared prefix: the second still gets every position (it does not
    take the cached blocks), and a plain request after them does hit the cache they wrote."""
    llm = make_llm(smollm, enable_prefix_caching=True, max_num_batched_tokens=24)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=K)
    first = llm.generate([prompts[4]], params, use_tqdm=False)
    second = llm.generate([prompts[5]], params, use_tqdm=False)
    check(first + second, prompts[4:6], hf_logprobs[4:6])
    assert second[0].metrics.num_cached_prompt_tokens == 0
    plain = llm.generate([prompts[5]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                         use_tqdm=False)
    assert plain[0].metrics.num_cached_prompt_tokens > 0 and plain[0].prompt_logprobs is None
    assert_no_leaks(llm)


def test_mixed_batch_and_n(smollm, prompts, hf_logprobs):
    """Requests with and without prompt logprobs in one batch, one with n=2 and k=0, one with logprobs."""
    llm = make_llm(smollm, max_num_batched_tokens=20)
    asks = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=K, logprobs=1)
    plain = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    zero = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=0, n=2)
    outs = llm.generate(prompts[:3], [asks, plain, zero], use_tqdm=False)
    check(outs[:1], prompts[:1], hf_logprobs[:1])
    assert outs[1].prompt_logprobs is None
    lp = outs[2].prompt_logprobs
    assert len(lp) == len(prompts[2]) and lp[0] is None
    for i in range(1, len(lp)):
        assert list(lp[i]) == [prompts[2][i]]
        assert abs(lp[i][prompts[2][i]].logprob - hf_logprobs[2][i - 1][prompts[2][i]].item()) < 1e-4
    assert outs[0].outputs[0].logprobs is not None
    assert_no_leaks(llm)


def test_one_token_prompt(smollm):
    llm = make_llm(smollm)
    out = llm.generate([[1]], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]
    assert_no_leaks(llm)


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_bad_prompt_logprobs(bad):
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


def test_slices_bound_the_logits(smollm, prompts, hf_logprobs):
    """The log-softmax runs slice_rows rows at a time: results do not depend on the slice size."""
    llm = make_llm(smollm)
    computer = llm.engine.runner.prompt_logprobs
    assert isinstance(computer, PromptLogprobsComputer)
    seen = []
    compute_logits = llm.engine.runner.model.compute_logits

    def counting(hidden):
        seen.append(hidden.shape[0])
        return compute_logits(hidden)

    computer.slice_rows = 5
    original = computer.compute
    computer.compute = lambda hidden, plan, _fn: original(hidden, plan, counting)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=K)
    outs = llm.generate(prompts[4:5], params, use_tqdm=False)
    check(outs, prompts[4:5], hf_logprobs[4:5])
    assert seen and max(seen) <= 5 and sum(seen) == len(prompts[4]) - 1
    assert_no_leaks(llm)
