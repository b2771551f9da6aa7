"""After an LLM is shut down (or deleted, without a garbage collection) the next one on the device
gets the whole memory for its KV cache again."""

import pytest
import torch

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.gpu

# A seeded dummy preset (the GPU machine has no embedded-model package); prompts as token ids.
OPTIONS = dict(model="smollm2-135m", load_format="dummy", device="cuda", dtype="bfloat16", max_model_len=2048,
               gpu_memory_utilization=0.5)
PROMPT = [[1, 2, 3, 4, 5]]
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def test_a_second_engine_gets_the_whole_kv_cache_after_shutdown_and_after_del():
    first = LLM(**OPTIONS)
    blocks = first.llm_engine.kv.num_blocks
    tokens = first.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    first.shutdown()
    second = LLM(**OPTIONS)
    # Within 2 %: the profiling run's activation peak may differ by a few blocks.
    assert second.llm_engine.kv.num_blocks >= 0.98 * blocks, (blocks, second.llm_engine.kv.num_blocks)
    assert second.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == tokens
    del second  # no shutdown, no gc.collect(): reference counting alone frees it
    third = LLM(**OPTIONS)
    assert third.llm_engine.kv.num_blocks >= 0.98 * blocks, (blocks, third.llm_engine.kv.num_blocks)
    third.shutdown()
    torch.cuda.synchronize()
