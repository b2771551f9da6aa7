"""Batch-invariant mode on the embedded model (CPU, fp32): 8 prompts give the same tokens and the
same logprobs, bit for bit, each alone, all together, and mixed with 36 other requests in chunked
prefill steps, for greedy and for seeded sampling; the greedy tokens are also HF's."""

import pytest

from tests.engine.conftest import CHAT_PROMPTS, NEW_TOKENS, assert_no_leaks, make_llm
from tokenmill.sampling_params import SamplingParams

TARGETS = CHAT_PROMPTS[:4] + [
    "def quicksort(items):",
    "SELECT name, count(*) FROM orders",
    "import numpy as np\nx = np.",
    "Dear committee, I am writing to",
]
TOKENS = 8


def _others(n: int) -> list[str]:
    """Requests of many prompt lengths (2 to ~120 tokens) to share the targets' steps."""
    words = "the river ran past stones and trees while birds sang of summer and of rain".split()
    return [f"Note {i}: " + " ".join(words[(i + j) % len(words)] for j in range(1 + (i * 7) % 90)) for i in range(n)]


def _params(seeded: bool, n: int, offset: int = 0) -> list[SamplingParams]:
    if not seeded:
        return [SamplingParams(temperature=0, max_tokens=TOKENS, logprobs=2)] * n
    return [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + offset + i, max_tokens=TOKENS, logprobs=2)
            for i in range(n)]


def _result(out):
    """(token ids, each position's logprob of every reported token) of one request."""
    c = out.outputs[0]
    return c.token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in c.logprobs]


@pytest.fixture(scope="module")
def engines(smollm):
    """A whole-prompt engine and a chunked-prefill one (64-token steps), both batch-invariant."""
    return (make_llm(smollm, batch_invariant=True, max_num_seqs=96, num_kv_blocks=1024),
            make_llm(smollm, batch_invariant=True, max_num_seqs=96, num_kv_blocks=1024, max_num_batched_tokens=64))


def test_alone_together_and_under_load_are_identical(engines):
    """Each target prompt once greedy and once seeded-sampled: alone, all together, and among 36
    other requests with chunked prefill, the tokens and logprobs are identical."""
    whole, chunked = engines
    targets = TARGETS + TARGETS
    params = _params(False, len(TARGETS)) + _params(True, len(TARGETS))
    alone = [_result(whole.generate([p], [sp], use_tqdm=False)[0]) for p, sp in zip(targets, params)]
    together = [_result(o) for o in whole.generate(targets, params, use_tqdm=False)]
    assert together == alone
    others = _others(36)
    other_params = [SamplingParams(temperature=0.7, seed=i, max_tokens=4 + i % 13) for i in range(36)]
    prompts = others[:20] + targets + others[20:]
    outs = chunked.generate(prompts, other_params[:20] + params + other_params[20:], use_tqdm=False)
    assert [_result(o) for o in outs[20:20 + len(targets)]] == alone
    assert max(len(chunked.engine.tokenize(p)) for p in others) > 64  # prompts really were chunked
    for llm in engines:
        assert_no_leaks(llm)


def test_greedy_equals_hf(engines, chat_prompt_ids, hf_greedy):
    """Under batch-invariant numerics the greedy tokens are still HF's fp32 greedy tokens (on the
    whole-prompt engine: the chunked one gives its tokens bit for bit, as the test above proves)."""
    whole, _ = engines
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    assert [o.outputs[0].token_ids for o in whole.generate(chat_prompt_ids, greedy, use_tqdm=False)] == hf_greedy
