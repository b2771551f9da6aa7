"""Greedy generation of a batch equals HF transformers' greedy generation of each prompt alone."""

import pytest

from tests.engine.conftest import NEW_TOKENS, assert_no_leaks, make_llm
from tokenmill.sampling_params import SamplingParams

# min_tokens = max_tokens masks EOS exactly as HF's min_new_tokens does.
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)

CONFIGS = {
    "default": {},
    "sync-scheduling": dict(async_scheduling=False),
    "chunked-prefill": dict(max_num_batched_tokens=24),
    "preemption": dict(num_kv_blocks=14),
    "max-num-seqs-2": dict(max_num_seqs=2),
    "no-prefix-caching": dict(enable_prefix_caching=False),
    "block-size-32": dict(block_size=32, num_kv_blocks=128),
}


def check_batch_matches_hf(llm, name: str, prompt_ids, hf_greedy) -> None:
    """The batch's greedy tokens are HF's for each prompt alone; the regime really happened."""
    outs = llm.generate(prompt_ids, GREEDY, use_tqdm=False)
    for out, ref in zip(outs, hf_greedy):
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].finish_reason == "length"
    if name == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batch_matches_hf_alone(name, smollm, chat_prompt_ids, hf_greedy):
    llm = make_llm(smollm, **CONFIGS[name])
    check_batch_matches_hf(llm, name, chat_prompt_ids, hf_greedy)
    if name == "chunked-prefill":
        assert max(len(p) for p in chat_prompt_ids) > 24  # prompts really were split
    assert_no_leaks(llm)


def test_shared_prefixes_hit_the_prefix_cache(smollm, chat_prompt_ids, hf_greedy, hf_smollm):
    import torch

    llm = make_llm(smollm)
    # The same prompts twice: the second round is served from the prefix cache. The first round
    # only prefills (its greedy tokens: test_batch_matches_hf_alone[default]).
    first = llm.generate(chat_prompt_ids, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    second = llm.generate(chat_prompt_ids, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [ref[:1] for ref in hf_greedy]
    assert [o.outputs[0].token_ids for o in second] == hf_greedy
    assert all(o.metrics.num_cached_prompt_tokens >= 16 for o in second)
    assert llm.engine.kv.prefix_hit_rate > 0.3
    # Prompts sharing a long system prompt, submitted together.
    tok = smollm.tokenizer
    system = "You are a careful assistant who answers briefly and precisely, citing facts only. " * 3
    prompts = []
    for q in ("Name a planet.", "Name a color.", "Name a fruit."):
        text = tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                       tokenize=False, add_generation_prompt=True)
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, min_tokens=16), use_tqdm=False)
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf_smollm.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                     pad_token_id=2)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref
    assert sum(o.metrics.num_cached_prompt_tokens for o in outs) >= 2 * 16
    assert_no_leaks(llm)


def test_host_tier_reloads_match_hf(smollm, chat_prompt_ids, hf_greedy):
    """The host-memory KV tier under a GPU cache of 10 blocks: the second pair of prompts evicts the
    first pair's blocks to the host; run again, the first pair loads them back. HF's tokens each time."""
    llm = make_llm(smollm, num_kv_blocks=10, max_num_seqs=2, kv_offloading_size=0.05)
    first = llm.generate(chat_prompt_ids[:4], GREEDY, use_tqdm=False)
    again = llm.generate(chat_prompt_ids[:2], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + again] == hf_greedy[:4] + hf_greedy[:2]
    assert all(o.metrics.num_host_cached_prompt_tokens > 0 for o in again)
    assert llm.engine.snapshot().kv_offload.blocks_loaded > 0
    assert_no_leaks(llm)
