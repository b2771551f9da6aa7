"""FP8 weights and the FP8 KV cache on CUDA, through the whole engine, against the CPU.

The CPU computes with the dequantized weights and dequantized keys and values (the references
of the kernels). In fp32 the CUDA run reads the same e4m3 weights in its GEMVs and the same
cache layout in its attention, in every scheduling regime (CUDA graphs, piecewise graphs,
chunked prefill, batch 1 with the fused GEMVs, eager), and must give the CPU's tokens. (bf16,
where larger steps quantize the activations too, is measured on real weights by
`tokenmill bench fidelity`.)
"""

import pytest
import torch

from tests.gpu.test_runner_cuda import cpu_model, run, to_cuda
from tokenmill.loader.quantize import quantize_model

pytestmark = pytest.mark.gpu

# On an H200 at 6f38e3a (2026-12-02) both tests below failed: with a full-precision cache 2 of 8
# prompts diverged and the logprobs before the divergence differed by up to 3.9e-3 in every
# regime alike. The cause: torch on CUDA divides by a Python number as a product with its rounded
# reciprocal, so 88,514 row scales and through them 55 weight bytes differed from the CPU's. Made
# on the CPU, that same quantization gives exactly that failure (prompts 2 and 7, 3.94e-3).
# quantization/fp8.py now divides correctly rounded on every device
# (test_fp8.py::test_quantization_is_the_same_on_every_device); the GPU has not run these since.


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


@pytest.mark.parametrize("overrides", REGIMES, ids=REGIME_IDS)
def test_fp8_kv_cache_greedy_matches_cpu_fp32(reference, overrides):
    """And with an FP8 KV cache. A key a hair from an e4m3 rounding edge may round the other way
    on the GPU (its fp32 sums differ from the CPU's in the last bits), and this random model
    notices a few such bytes: on the CPU, moving every key and value by at most 2 ulp before the
    rounding makes 2 of the 8 prompts diverge, with logprobs up to 0.021 apart before that
    (2026-12-02). The bounds allow that much and a little more, not the 7-8 prompts and 0.12 of
    the broken scales."""
    _, gpu, outs = reference
    llm, gpu_outs = run(gpu, kv_cache_dtype="fp8", **overrides)
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    mismatched, worst = _compare(gpu_outs, outs["fp8"])
    assert len(mismatched) <= 3 and worst < 5e-2, (mismatched, worst)
