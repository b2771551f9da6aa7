"""FP8 weights and the FP8 KV cache on CUDA, through the whole engine, against the CPU.

The CPU computes with the dequantized weights and dequantized keys and values (the references
of the kernels). In fp32 the CUDA run reads the same e4m3 weights in its GEMVs and the same
cache layout in its attention, in every scheduling regime (CUDA graphs, piecewise graphs,
chunked prefill, batch 1 with the fused GEMVs, eager), and must give the CPU's tokens. In bf16,
where steps quantize the activations too, the teacher-forced logprobs stay within the size of the
weights' own quantization effect (test_fp8_weights_in_bf16_teacher_forced); on real weights,
`tokenmill bench fidelity` measures it.
"""

import pytest
import torch

from tests.gpu.test_runner_cuda import cpu_model, prompts, run, to_cuda
from tokenmill.loader.quantize import quantize_model

pytestmark = pytest.mark.gpu

# On an H200 at 6f38e3a (2026-12-02) both tests below failed: with a full-precision cache 2 of 8
# prompts diverged and the logprobs before the divergence differed by up to 3.9e-3 in every
# regime alike. The cause: torch on CUDA divides by a Python number as a product with its rounded
# reciprocal, so 88,514 row scales and through them 55 weight bytes differed from the CPU's. Made
# on the CPU, that same quantization gives exactly that failure (prompts 2 and 7, 3.94e-3).
# quantization/fp8.py now divides correctly rounded on every device
# (test_fp8.py::test_quantization_is_the_same_on_every_device); at fc6364a the FP8-weight test
# passed in all five regimes on the H200. The FP8-cache test is teacher-forced since (below).


@pytest.fixture(scope="module")
def reference():
    """The smollm2-135m shapes with seeded dummy weights: (fp32 CPU model, an fp32 CUDA copy, the
    CPU's FP8-weight outputs with a full-precision cache and with an FP8 one)."""
    cpu = cpu_model("smollm2-135m")
    gpu32 = to_cuda(cpu, torch.float32)  # quantized on each device from the same fp32 weights
    quantize_model(cpu.model, "fp8")
    quantize_model(gpu32.model, "fp8")
    outs = {kv: run(cpu, kv_cache_dtype=kv)[1] for kv in ("auto", "fp8")}
    return cpu, gpu32, outs


def _compare(gpu_outs, cpu_outs):
    """(prompts whose tokens differ, the largest logprob difference over the equal prefixes)."""
    mismatched, worst = [], 0.0
    for i, (ours, ref) in enumerate(zip(gpu_outs, cpu_outs)):
        if ours.token_ids != ref.token_ids:
            mismatched.append(i)
        for a, b, ta, tb in zip(ours.logprobs, ref.logprobs, ours.token_ids, ref.token_ids):
            worst = max([worst] + [abs(a[t].logprob - lp.logprob) for t, lp in b.items() if t in a])
            if ta != tb:
                break
    return mismatched, worst


REGIMES = [{}, {"max_num_batched_tokens": 64}, {"enforce_eager": True}, {"max_num_seqs": 1},
           {"piecewise_cuda_graph_max_tokens": 0}]
REGIME_IDS = ["graphs", "chunked-prefill", "eager", "batch-1", "no-piecewise"]


@pytest.mark.parametrize("overrides", REGIMES, ids=REGIME_IDS)
def test_fp8_weights_greedy_matches_cpu_fp32(reference, overrides):
    """The same e4m3 weights: the GEMVs' and the dequantized matmuls' tokens and logprobs equal
    the CPU's as fp32 ones do (tests/gpu/test_runner_cuda.py)."""
    _, gpu, outs = reference
    linear = gpu.model.model.layers[0].mlp.down_proj
    assert linear.weight.dtype == torch.float8_e4m3fn and linear.weight.is_cuda
    _, gpu_outs = run(gpu, **overrides)
    mismatched, worst = _compare(gpu_outs, outs["auto"])
    assert not mismatched and worst < 1e-3, (mismatched, worst)


def test_fp8_greedy_with_speculation_prefix_cache_and_chunks(reference):
    """FP8 weights with speculation (drafts from the first 4 layers: every decode step verifies 3
    drafts a request, so the verify steps' several-token queries run through the FP8 GEMVs and
    matmuls), chunked prefill and the prefix cache (the prompts a second time hit it): every
    request's greedy tokens are the CPU's over the same weights, in both runs. (With the FP8 cache
    the e4m3 rounding of keys makes tokens depend on the batch's rounding: the teacher-forced test
    above bounds that.)"""
    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    _, gpu, outs = reference
    spec = {"method": "layer_truncated", "num_draft_layers": 4, "num_speculative_tokens": 3}
    config = EngineConfig(num_kv_blocks=512, max_num_seqs=16, max_num_batched_tokens=64, max_model_len=2048,
                          enable_prefix_caching=True, speculative_config=spec)
    llm = LLM.from_engine(LLMEngine(config=config, loaded=gpu))
    ps = prompts(gpu.arch.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=len(outs["auto"][0].token_ids), ignore_eos=True)
    want = [o.token_ids for o in outs["auto"]]
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)] == want
    assert llm.engine.spec_stats.drafts > 0 and llm.engine.kv.prefix_hits > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def _teacher_forced(loaded, seqs, **overrides):
    """Each sequence's logprob of its own next token at every position (prompt logprobs, so no
    step depends on an earlier greedy choice)."""
    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    config = EngineConfig(**{"num_kv_blocks": 512, "max_num_seqs": 16, "max_num_batched_tokens": 2048,
                             "max_model_len": 2048, **overrides})
    llm = LLM.from_engine(LLMEngine(config=config, loaded=loaded))
    outs = llm.generate(seqs, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    return llm, [[lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], seq[1:])] for o, seq in zip(outs, seqs)]


@pytest.fixture(scope="module")
def teacher_forced_reference(reference):
    """The prompts with the CPU's greedy FP8-cache tokens, and the CPU's teacher-forced logprobs on
    them with the FP8 cache and with a full-precision one."""
    cpu, _, outs = reference
    seqs = [p + o.token_ids for p, o in zip(prompts(cpu.arch.vocab_size), outs["fp8"])]
    return seqs, _teacher_forced(cpu, seqs, kv_cache_dtype="fp8")[1], _teacher_forced(cpu, seqs)[1]


def _abs_diffs(a, b) -> torch.Tensor:
    return torch.tensor([abs(x - y) for g, w in zip(a, b) for x, y in zip(g, w)])


@pytest.mark.parametrize("overrides", REGIMES, ids=REGIME_IDS)
def test_fp8_kv_cache_matches_cpu_fp32_teacher_forced(reference, teacher_forced_reference, overrides):
    """And with an FP8 KV cache, teacher-forced over the prompts and the CPU's greedy tokens. The
    cache makes this computation discontinuous: a key a hair from an e4m3 rounding edge may round
    the other way on the GPU (its fp32 sums differ from the CPU's in the last bits), and each such
    byte moves the next layers enough to flip more. The CPU shows the cascade with Triton's
    kernels (in the interpreter) against the torch paths (2026-12-02): the same bytes in layer 0,
    1 differing byte in layer 1, 71 and 108 (k, v) in layer 2, and teacher-forced logprobs up to
    0.038 apart (mean 7.7e-3), where a full-precision cache keeps them within 2e-5. Greedy runs of
    this random model part ways from that (on the H200, fc6364a: 5 to 7 of 8 prompts), so the
    test compares every position, against what the FP8 cache itself changes (the CPU with a
    full-precision cache: mean 0.237, max 1.52): the H200 gave mean 8.7e-3 to 9.0e-3 and max
    0.080-0.107 (3 regimes), a twenty-fifth and a fourteenth of that. A wrong scale or byte
    layout would move them as much as the quantization does."""
    _, gpu, _ = reference
    seqs, want, full_precision = teacher_forced_reference
    llm, got = _teacher_forced(gpu, seqs, kv_cache_dtype="fp8", **overrides)
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    diffs, effect = _abs_diffs(got, want), _abs_diffs(want, full_precision)
    print(f"teacher-forced |logprob difference|: max {diffs.max():.3e}, mean {diffs.mean():.3e}; the FP8 "
          f"cache's own: max {effect.max():.3e}, mean {effect.mean():.3e} ({len(diffs)} positions)")
    assert diffs.mean() < 0.1 * effect.mean() and diffs.max() < 0.25 * effect.max(), (diffs, effect)


@pytest.fixture(scope="module")
def bf16_reference(teacher_forced_reference):
    """A bf16 CUDA model with the CPU's e4m3 weights and scales (quantized from the same fp32
    weights; the other parameters in bf16), and the CPU's teacher-forced logprobs without FP8
    weights (the same seeded fp32 model, unquantized)."""
    plain = cpu_model("smollm2-135m")
    seqs = teacher_forced_reference[0]
    unquantized = _teacher_forced(plain, seqs)[1]
    gpu = to_cuda(plain, torch.float32)
    quantize_model(gpu.model, "fp8")
    for name, p in gpu.model.named_parameters():
        if p.dtype == torch.float32 and not name.endswith("weight_scale"):  # the scales stay fp32, as loaded
            p.data = p.data.to(torch.bfloat16)
    gpu.dtype = torch.bfloat16
    return gpu, unquantized


@pytest.mark.parametrize("overrides", REGIMES, ids=REGIME_IDS)
def test_fp8_weights_in_bf16_teacher_forced(teacher_forced_reference, bf16_reference, overrides):
    """FP8 weights in a bf16 model: the prompts' steps quantize the activations per token and run
    the e4m3 x e4m3 products (the fused quantizing norm and SiLU-and-mul, the Triton matmul at up to
    128 tokens a step, cuBLAS beyond), so besides bf16's roundings they add an error of the same
    kind and size as the weights' own quantization. Teacher-forced against the CPU's fp32 run with
    the same e4m3 weights, the difference is bounded by what the weights' quantization itself
    changes (the CPU without FP8 weights). On the H200 (2026-12-02, five regimes): mean 0.416-0.422
    against the weights' own 0.424, max 3.11-3.22 against 1.88 (802 positions; this random model's
    logprobs move a lot under any quantization). A wrong scale, byte order or tile would move them
    far more; an error smaller than the quantization's own would pass unseen (the kernels' own
    tests bound those)."""
    seqs, _, want = teacher_forced_reference
    gpu, unquantized = bf16_reference
    llm, got = _teacher_forced(gpu, seqs, **overrides)
    linear = llm.engine.runner.model.model.layers[0].mlp.down_proj
    assert linear.weight.dtype == torch.float8_e4m3fn and linear.weight_scale.dtype == torch.float32
    assert llm.engine.runner.model.model.norm.weight.dtype == torch.bfloat16
    diffs, effect = _abs_diffs(got, want), _abs_diffs(want, unquantized)
    print(f"bf16 FP8 teacher-forced |logprob difference|: max {diffs.max():.3e}, mean {diffs.mean():.3e}; the "
          f"weights' quantization's own: max {effect.max():.3e}, mean {effect.mean():.3e} ({len(diffs)} positions)")
    assert diffs.mean() < 1.25 * effect.mean() and diffs.max() < 2.5 * effect.max(), (diffs, effect)
