"""Speculative decoding on CUDA: greedy output with n-gram drafts equals greedy output without them
(fp32), with verify steps replaying their full CUDA graphs or running eagerly, batched or alone;
the real embedded model accepts drafts on a prompt-copying request; probabilistic verification runs
the sampling stages on the device.

The no-sync test with speculation lives in test_no_sync.py.
"""

import random

import pytest
import torch

from tests.gpu.test_runner_cuda import cpu_model, to_cuda
from tests.gpu.test_warmup_real_weights import _gguf_path
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.llm import LLM
from tokenmill.loader.load import load_model
from tokenmill.runner.cuda_graphs import GraphMode
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def repeating_prompts(vocab: int, n: int = 8) -> list[list[int]]:
    """Prompts made of a short random phrase said several times: the lookup finds n-grams in them."""
    rng = random.Random(0)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(vocab) for _ in range(rng.randint(4, 12))]
        out.append([rng.randrange(vocab) for _ in range(rng.randint(0, 30))] + phrase * rng.randint(3, 6))
    return out


def generate(loaded, prompts, params, **overrides):
    config = EngineConfig(**{"num_kv_blocks": 512, "max_num_seqs": 16, "max_num_batched_tokens": 2048,
                             "max_model_len": 2048, **overrides})
    llm = LLM.from_engine(LLMEngine(config=config, loaded=loaded))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def smollm_fp32():
    # The loader's own dummy initialisation (not cpu_model's): its greedy outputs repeat tokens, so
    # the lookup finds n-grams in them (with cpu_model's weights nothing ever matched).
    cpu = load_model("smollm2-135m", load_format="dummy", device="cpu", dtype="float32", max_positions=2048)
    gpu = to_cuda(cpu, torch.float32)
    prompts = repeating_prompts(cpu.arch.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    _, ref = generate(gpu, prompts, params)
    return gpu, prompts, params, ref


def _count_verify_replays(bank, query_len: int) -> dict:
    seen = {"replays": 0}
    run = bank.run

    def counted(key, meta):
        if key.mode is GraphMode.FULL and key.query_len == query_len:
            seen["replays"] += 1
        return run(key, meta)

    bank.run = counted
    return seen


@pytest.mark.parametrize("overrides", [{}, {"enforce_eager": True}, {"max_num_seqs": 1}, {"async_scheduling": False},
                                       {"max_num_batched_tokens": 64}, {"piecewise_cuda_graph_max_tokens": 0}],
                         ids=["graphs+async", "eager", "batch-1", "sync", "chunked-prefill", "no-piecewise"])
def test_greedy_with_ngram_matches_plain(smollm_fp32, overrides):
    gpu, prompts, params, ref = smollm_fp32
    config = {"num_kv_blocks": 512, "max_num_seqs": 16, "max_num_batched_tokens": 2048, "max_model_len": 2048,
              "speculative_config": NGRAM, **overrides}
    engine = LLMEngine(config=EngineConfig(**config), loaded=gpu)
    runner = engine.runner
    q = 1 + NGRAM["num_speculative_tokens"]
    seen = _count_verify_replays(runner.graphs, q)
    llm = LLM.from_engine(engine)
    if overrides.get("max_num_seqs") == 1:  # one request at a time: every decode is a uniform verify step
        out = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    else:
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert out == ref
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    stats = engine.spec_stats
    assert stats.drafts > 0, "no draft was verified"
    if overrides.get("enforce_eager"):
        assert not runner.graphs.keys(GraphMode.FULL, query_len=q)
    else:
        assert runner.graphs.keys(GraphMode.FULL, query_len=q)
        if overrides.get("max_num_seqs") == 1:
            assert seen["replays"] > 0, "no verify step replayed a graph"


def test_real_model_accepts_drafts_on_copying_prompt():
    """The embedded model in bf16 on a request that copies a passage: drafts are accepted and
    fewer steps are needed; in fp32 the tokens equal those without speculation."""
    path = _gguf_path()
    passage = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
               "def mul(a, b):\n    return a * b\n")
    messages = [{"role": "user", "content": f"Repeat this code exactly:\n\n{passage}"}]
    params = SamplingParams(temperature=0, max_tokens=64)
    for dtype in ("float32", "bfloat16"):
        outs = {}
        for spec in (None, NGRAM):
            engine = LLMEngine(path, EngineConfig(max_num_seqs=8, max_model_len=2048, num_kv_blocks=1024,
                                                  speculative_config=spec), dtype=dtype, device="cuda")
            llm = LLM.from_engine(engine)
            out = llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
            outs[spec is not None] = (out.token_ids, engine.steps_completed, engine.spec_stats)
            del llm, engine
        (plain, plain_steps, _), (spec_ids, spec_steps, stats) = outs[False], outs[True]
        if dtype == "float32":
            assert spec_ids == plain
        assert stats.acceptance_rate > 0.3 and spec_steps < plain_steps, (dtype, stats.summary(), spec_steps)


@pytest.mark.parametrize("synthetic", [None, 0.7])
def test_sampled_verification_is_seeded(synthetic):
    """Temperature/top-k/top-p/min-p on the target's distribution with probabilistic acceptance:
    a seeded request gives the same tokens in two engines."""
    cpu = cpu_model("smollm2-135m")
    gpu = to_cuda(cpu, torch.bfloat16)
    spec = dict(NGRAM, synthetic_acceptance=synthetic) if synthetic is not None else NGRAM
    prompts = repeating_prompts(cpu.arch.vocab_size, 4)
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, seed=i, max_tokens=40,
                             ignore_eos=True) for i in range(4)]
    _, a = generate(gpu, prompts, params, speculative_config=spec)
    llm, b = generate(gpu, prompts, params, speculative_config=spec)
    assert a == b and all(len(t) == 40 for t in a)
    if synthetic is not None:
        assert llm.engine.spec_stats.mean_accepted_length > 1.5
