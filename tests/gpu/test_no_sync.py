"""The decode loop launches each step without any CPU/GPU synchronisation."""

import pytest
import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, max_tokens=64, ignore_eos=True,
                   presence_penalty=0.5, repetition_penalty=1.1, logit_bias={5: 1.0}, logprobs=3, seed=1),
], ids=["greedy", "all-sampling-stages"])
@pytest.mark.parametrize("num_requests", [8, 1], ids=["batch-8", "batch-1"])  # batch 1: the fused GEMV path
def test_step_path_never_syncs(enforce_eager, params, num_requests):
    _check_no_sync(EngineConfig(num_kv_blocks=256, max_num_seqs=16, enforce_eager=enforce_eager), params, num_requests)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
SYNTHETIC = {"method": "ngram", "num_speculative_tokens": 3, "synthetic_acceptance": 0.7}
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, max_tokens=64, ignore_eos=True, seed=1)
PLAIN = SamplingParams(temperature=0.8, max_tokens=64, ignore_eos=True, repetition_penalty=1.1, logprobs=2)


@pytest.mark.parametrize("enforce_eager, spec, params, num_requests", [
    (False, NGRAM, GREEDY, 1), (False, NGRAM, GREEDY, 8), (False, SYNTHETIC, SAMPLED, 1),
    (False, SYNTHETIC, SAMPLED, 8), (True, SYNTHETIC, SAMPLED, 8), (False, NGRAM, PLAIN, 8),
], ids=["graphs-ngram-greedy-batch-1", "graphs-ngram-greedy-batch-8", "graphs-synthetic-sampled-batch-1",
        "graphs-synthetic-sampled-batch-8", "eager-synthetic-sampled-batch-8", "graphs-ngram-plain-decoding-batch-8"])
def test_speculative_step_path_never_syncs(enforce_eager, spec, params, num_requests):
    """Verify steps (graphs or eager), the rejection sampler, the post-update and the n-gram proposer."""
    _check_no_sync(EngineConfig(num_kv_blocks=256, max_num_seqs=16, enforce_eager=enforce_eager,
                                speculative_config=spec), params, num_requests, min_steps=10)


def _check_no_sync(config: EngineConfig, params: SamplingParams, num_requests: int, min_steps: int = 80) -> None:
    engine = LLMEngine("smollm2-135m", config, load_format="dummy", dtype="bfloat16", device="cuda")
    runner = engine.runner
    checked = {"steps": 0}

    def guarded(fn):
        def wrapper(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                checked["steps"] += 1
        return wrapper

    for i in range(num_requests):
        engine.add_request([1 + i] * (10 + 5 * i), params)
    while engine.scheduler.waiting or any(r.is_prefilling for r in engine.scheduler.running):
        engine.step()  # prefill (may compile kernels) outside the check
    runner.execute_model = guarded(runner.execute_model)
    runner.sample_tokens = guarded(runner.sample_tokens)
    finished = 0
    while engine.has_unfinished_requests():
        finished += sum(o.finished for o in engine.step())
    assert finished == num_requests and checked["steps"] > min_steps
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_kv_cache_sized_from_memory():
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    engine = LLMEngine("qwen3-0.6b", EngineConfig(gpu_memory_utilization=0.5, max_model_len=4096),
                       load_format="dummy", device="cuda")
    free, total = torch.cuda.mem_get_info()
    used = total - free
    assert engine.kv.num_blocks > 1000
    assert used <= 0.55 * total, (used / 2**30, total / 2**30)
