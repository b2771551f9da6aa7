"""FP8 (e4m3) weights: quantization, the GEMV kernels reading FP8 weights (plain, with the prologues,
several rows, the rotary-fused q/k/v one) against their references on the dequantized weight, the
_scaled_mm path against its reference (CUDA), a quantized model against the same model carrying the
dequantized weights, and the errors for what is not supported."""

import json

import pytest
import torch

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.errors import ModelLoadError
from tokenmill.kernels.qkv_rope_gemv import skinny_qkv_rope_ref, skinny_qkv_rope_triton
from tokenmill.kernels.skinny_gemm import ADD_RMSNORM, PLAIN, SILU_MUL, skinny_linear_ref, skinny_linear_triton
from tokenmill.layers.rotary import RotaryEmbedding, rope_inv_freq
from tokenmill.quantization.fp8 import (FP8_MAX, dequantize_weight_fp8, fp8_linear, fp8_linear_ref,
                                        quantize_weight_fp8)

from tests.kernels.common import CUDA, DEVICES, TOL, nan_empty, rel_err  # noqa: F401


def test_quantize_round_trip():
    torch.manual_seed(0)
    w = torch.randn(64, 96) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different sizes
    w[5] = 0  # an all-zero row
    w_q, scale = quantize_weight_fp8(w)
    assert w_q.dtype == torch.float8_e4m3fn and scale.shape == (64,) and scale.dtype == torch.float32
    assert torch.allclose(w_q.float().abs().amax(dim=1)[torch.arange(64) != 5], torch.tensor(FP8_MAX))
    back = dequantize_weight_fp8(w_q, scale, torch.float32)
    assert torch.equal(back[5], torch.zeros(96))
    rows = torch.arange(64) != 5
    # e4m3 keeps 3 mantissa bits: each element within 1/16 of its row's scale-relative size
    err = ((back - w).abs() / w.abs().amax(dim=1, keepdim=True).clamp(min=1e-30))[rows]
    assert err.max() <= 1 / 16 + 1e-6
    assert rel_err(back, w) < 0.04


def _weights(n, k, dtype, device):
    w = torch.randn(n, k, device=device) / k ** 0.5
    w_q, scale = quantize_weight_fp8(w)
    return w_q, scale, dequantize_weight_fp8(w_q, scale, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("prologue", [PLAIN, SILU_MUL, ADD_RMSNORM], ids=["plain", "silu", "norm"])
def test_gemv_reads_fp8_weights(device, rows, prologue, nan_empty):
    cases = [(48, 64, torch.float32)] if device == "cpu" else [(6144, 4096, torch.bfloat16),
                                                               (4096, 14336, torch.bfloat16), (48, 64, torch.float32)]
    for n, k, dtype in cases:
        torch.manual_seed(n + k + rows)
        w_q, scale, w_deq = _weights(n, k, dtype, device)
        x = torch.randn(rows, 2 * k if prologue == SILU_MUL else k, device=device, dtype=dtype)
        res = torch.randn(rows, k, device=device, dtype=dtype) if prologue == ADD_RMSNORM else None
        nw = (1 + 0.1 * torch.randn(k, device=device)).to(dtype) if prologue == ADD_RMSNORM else None
        out = skinny_linear_triton(x, w_q, prologue, res, nw, 1e-5, weight_scale=scale)
        ref = skinny_linear_ref(x, w_deq, prologue, res, nw, 1e-5)
        if res is not None:
            (out, summed), (ref, summed_ref) = out, ref
            assert torch.equal(summed, summed_ref)
        assert rel_err(out, ref) < TOL[dtype], (n, k, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_qkv_rope_gemv_reads_fp8_weights(device, nan_empty):
    cases = [(64, 4, 2, 16, torch.float32)] + ([(4096, 32, 8, 128, torch.bfloat16)] if device == "cuda" else [])
    for hidden, hq, hk, d, dtype in cases:
        torch.manual_seed(hidden)
        w_q, scale, w_deq = _weights((hq + 2 * hk) * d, hidden, dtype, device)
        common = dict(x=torch.randn(1, hidden, device=device, dtype=dtype),
                      residual=torch.randn(1, hidden, device=device, dtype=dtype),
                      norm_weight=(1 + 0.1 * torch.randn(hidden, device=device)).to(dtype), eps=1e-5,
                      positions=torch.tensor([321], device=device),
                      cos_sin_cache=RotaryEmbedding(d, 4096, rope_inv_freq(d, 500000.0),
                                                    device=device).cos_sin_cache,
                      slot_mapping=torch.tensor([5], device=device), num_q_heads=hq, num_kv_heads=hk)
        caches = [torch.zeros(2, 16, hk, d, device=device, dtype=dtype) for _ in range(4)]
        q, summed = skinny_qkv_rope_triton(weight=w_q, weight_scale=scale, k_cache=caches[0], v_cache=caches[1],
                                           **common)
        q_ref, summed_ref = skinny_qkv_rope_ref(weight=w_deq, k_cache=caches[2], v_cache=caches[3], **common)
        assert rel_err(q, q_ref) < TOL[dtype] and torch.equal(summed, summed_ref)
        assert rel_err(caches[0][0, 5], caches[2][0, 5]) < TOL[dtype]
        assert rel_err(caches[1][0, 5], caches[3][0, 5]) < TOL[dtype]


@pytest.mark.parametrize("device", DEVICES)
def test_quantization_is_the_same_on_every_device(device):
    """Scales are max|w| / 448 correctly rounded, so a GPU quantizes exactly as the CPU does
    (CUDA's division by a Python number is not: it multiplies by the rounded reciprocal)."""
    torch.manual_seed(3)
    w = torch.randn(512, 256) * torch.rand(512, 1) * 3
    w_q, scale = quantize_weight_fp8(w.to(device))
    want = (w.abs().amax(dim=1).double() / 448).float()
    assert torch.equal(scale.cpu(), want)
    w_q_cpu, _ = quantize_weight_fp8(w)
    assert torch.equal(w_q.cpu().view(torch.uint8), w_q_cpu.view(torch.uint8))
    x = torch.randn(4, 256, device=device) * 5
    from tokenmill.quantization.fp8 import quantize_activation_fp8
    _, x_scale = quantize_activation_fp8(x)
    assert torch.equal(x_scale.cpu(), (x.cpu().abs().amax(dim=1, keepdim=True).double() / 448).float())


def test_fp8_linear_on_the_cpu_is_the_dequantized_matmul():
    w_q, scale, w_deq = _weights(32, 48, torch.float32, "cpu")
    x = torch.randn(5, 48)
    assert torch.equal(fp8_linear(x, w_q, scale), x @ w_deq.t())


@pytest.mark.parametrize("device", [CUDA])
def test_scaled_mm_path_matches_its_reference(device):
    """Activations quantized per token, e4m3 x e4m3 on the tensor cores (Llama-3.1-8B shapes)."""
    for m, n, k in ((64, 6144, 4096), (512, 28672, 4096), (17, 4096, 14336)):
        w_q, scale, w_deq = _weights(n, k, torch.bfloat16, device)
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        out = fp8_linear(x, w_q, scale)
        assert rel_err(out, fp8_linear_ref(x, w_q, scale, quantize_input=True)) < 1e-2
        assert rel_err(out, x @ w_deq.t()) < 0.06  # what quantizing the activations costs


@pytest.mark.parametrize("device", [CUDA])
def test_cublas_fast_accumulation_error(device):
    """Prefill-sized steps take cuBLAS with fast accumulation (scaled_mm_e4m3): against a float64
    product of the same e4m3 operands, within 5e-3 at down's K of 14,336 (3.3e-3 measured on the
    H200, the bf16 output's own rounding 1.7e-3 of it)."""
    from tokenmill.quantization.fp8 import quantize_activation_fp8

    for m, n, k in ((1024, 4096, 14336), (1024, 6144, 4096)):
        w_q, scale, _ = _weights(n, k, torch.bfloat16, device)
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        x_q, x_scale = quantize_activation_fp8(x)
        want = (x_q.double() * x_scale.double()) @ (w_q.double() * scale.double()[:, None]).t()
        assert rel_err(fp8_linear(x, w_q, scale).double(), want) < 5e-3


def _teacher_forced_logprobs(llm, prompts):
    from tokenmill.sampling_params import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.prompt_logprobs for o in outs]


def _assert_same_outputs(llm, reference, prompts) -> None:
    """The same greedy tokens, and prompt logprobs (top 3) within 1e-5 (fp32)."""
    tokens, logprobs = _teacher_forced_logprobs(llm, prompts)
    want_tokens, want_logprobs = _teacher_forced_logprobs(reference, prompts)
    assert tokens == want_tokens
    for got, want in zip(logprobs, want_logprobs):
        for g, w in zip(got[1:], want[1:]):
            assert g.keys() == w.keys() and all(abs(g[t].logprob - w[t].logprob) < 1e-5 for t in w)


def test_quantized_model_equals_the_model_with_dequantized_weights():
    """tiny-llama with quantization="fp8" on the CPU against the same model whose linear weights are
    replaced by their dequantized FP8 values: the same greedy tokens and prompt logprobs (fp32)."""
    from tests.engine.conftest import make_llm
    from tokenmill.layers.linear import LinearBase
    from tokenmill.loader import load_model

    quantized = load_model("tiny-llama", load_format="dummy", device="cpu", dtype="float32", quantization="fp8")
    linears = [m for m in quantized.model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.weight.dtype == torch.float8_e4m3fn and m.weight_scale is not None for m in linears)
    reference = load_model("tiny-llama", load_format="dummy", device="cpu", dtype="float32")
    full = {name: m.weight.detach().clone() for name, m in reference.model.named_modules() if isinstance(m, LinearBase)}
    for name, m in reference.model.named_modules():
        if isinstance(m, LinearBase):
            w_q, scale = quantize_weight_fp8(m.weight.data)
            m.weight.data.copy_(dequantize_weight_fp8(w_q, scale, torch.float32))
    assert any(not torch.equal(full[n], m.weight) for n, m in reference.model.named_modules() if n in full)
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(6 + 3 * i)] for i in range(4)]
    _assert_same_outputs(make_llm(quantized), make_llm(reference), prompts)


def test_what_is_not_supported_is_refused(tmp_path):
    from tokenmill.loader import load_model
    from tests.test_hf_dir_models import _save_random_hf_model

    with pytest.raises(ConfigError, match="quantization must be one of fp8"):
        EngineConfig(quantization="int4").validate()
    with pytest.raises(ModelLoadError, match="quantization method 'awq' is not supported"):
        load_model("tiny-llama", load_format="dummy", device="cpu", quantization="awq")
    _save_random_hf_model("llama3.1", False, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="quant_method 'gptq'"):
        load_model(str(tmp_path), device="cpu")


# Not under the CPU interpreter: it rounds float32 -> e4m3 wrongly for some values (2.5 % of them
# a binade off, 2026-12-01), while the GPU's conversion rounds to nearest even as torch does.
@pytest.mark.parametrize("device", [CUDA])
def test_per_token_quantization_kernel_matches_torch(device):
    from tokenmill.kernels.fp8_quant import quantize_per_token_fp8_triton
    from tokenmill.quantization.fp8 import quantize_activation_fp8

    shapes = [(1, 4096), (77, 14336), (4096, 4096), (3, 40)]
    for m, k in shapes:
        x = (torch.randn(m, k, device=device) * torch.logspace(-2, 2, m, device=device)[:, None])
        x[0] = 0  # an all-zero row
        for dtype in (torch.float32, torch.bfloat16):
            q, s = quantize_per_token_fp8_triton(x.to(dtype))
            q_ref, s_ref = quantize_activation_fp8(x.to(dtype))
            torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
            assert torch.equal(q.float(), q_ref.float()), (m, k, dtype)


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _write_fp8_checkpoint(src, dst, fmt: str, strategy: str) -> dict:
    """A copy of the HF directory `src` with its projections stored as FP8 in the format's own
    layout: fmt "fp8" (quant_method fp8, per-tensor scales, static input scales) or
    "compressed-tensors" (float-quantized, per-channel or per-tensor scales). Returns each
    projection's dequantized weight (what tokenmill must compute with)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    out, dequantized = {}, {}
    for name, t in tensors.items():
        if not any(f".{p}.weight" in name for p in PROJECTIONS):
            out[name] = t
            continue
        w = t.float()
        if strategy == "channel":
            w_q, scale = quantize_weight_fp8(w)
            stored = scale[:, None]  # [N, 1], as compressed-tensors stores channel scales
        else:
            scale = (w.abs().max() / FP8_MAX).reshape(1)
            w_q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            stored = scale.reshape(()) if fmt == "fp8" else scale
        out[name] = w_q
        out[name.replace(".weight", ".weight_scale")] = stored
        if fmt == "fp8":
            out[name.replace(".weight", ".input_scale")] = torch.tensor(0.05)  # static: not used
        dequantized[name] = w_q.float() * (scale[:, None] if strategy == "channel" else scale)
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    if fmt == "fp8":
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    else:
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                                                      "symmetric": True, "dynamic": False},
                                          "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                                "symmetric": True, "dynamic": True}}}}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dequantized


@pytest.mark.parametrize("fmt,strategy", [("fp8", "tensor"), ("compressed-tensors", "channel"),
                                          ("compressed-tensors", "tensor")])
def test_fp8_checkpoints_load_as_stored(tmp_path, fmt, strategy):
    """Each format's FP8 checkpoint loads without requantizing: the e4m3 bytes and scales as stored
    (per-tensor scales spread over the rows of each q/k/v and gate/up shard); the model computes what
    the full-precision model computes with the dequantized weights."""
    from safetensors.torch import load_file, save_file

    from tests.engine.conftest import make_llm
    from tests.test_hf_dir_models import _save_random_hf_model
    from tokenmill.layers.linear import LinearBase
    from tokenmill.loader import load_model

    _save_random_hf_model("llama3.1", False, tmp_path / "full")
    dequantized = _write_fp8_checkpoint(tmp_path / "full", tmp_path / "fp8", fmt, strategy)
    loaded = load_model(str(tmp_path / "fp8"), device="cpu", dtype="float32")
    linears = [m for m in loaded.model.modules() if isinstance(m, LinearBase)]
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in linears)
    stored = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    qkv = loaded.model.model.layers[0].self_attn.qkv_proj
    want = torch.cat([stored[f"model.layers.0.self_attn.{p}.weight"].float() for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(qkv.weight.float(), want)  # the bytes as stored
    # the reference: the full-precision directory with the dequantized projections
    full = load_file(str(tmp_path / "full" / "model.safetensors"))
    full.update({k: v for k, v in dequantized.items()})
    save_file(full, str(tmp_path / "full" / "model.safetensors"))
    reference = load_model(str(tmp_path / "full"), device="cpu", dtype="float32")
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(6 + 3 * i)] for i in range(4)]
    _assert_same_outputs(make_llm(loaded), make_llm(reference), prompts)


def test_fp8_checkpoints_that_are_not_supported_are_refused(tmp_path):
    from tests.test_hf_dir_models import _save_random_hf_model
    from tokenmill.loader import load_model

    _save_random_hf_model("llama3.1", False, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cases = [
        ({"quant_method": "fp8", "weight_block_size": [64, 64]}, r"only \[128, 128\] blocks"),  # test_fp8_blockwise.py
        ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {}}, "format 'int-quantized'"),
        ({"quant_method": "compressed-tensors", "format": "float-quantized",
          "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                                       "strategy": "group", "group_size": 128}}}},
         "per channel or per tensor"),
        ({"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["model.layers.0.mlp.down_proj"],
          "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                                       "strategy": "channel"}}}},
         "other than the LM head"),
        ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
    ]
    for qc, message in cases:
        (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
        with pytest.raises(ModelLoadError, match=message):
            load_model(str(tmp_path), device="cpu")


@pytest.mark.parametrize("source,layout", [("checkpoint", "tp2"), ("online", "tp2"), ("online", "pp2+fp8-kv")])
def test_fp8_with_tensor_parallelism_equals_one_process(tmp_path, source, layout):
    """TP = 2 (gloo): each rank takes its rows of the FP8 weights and scales (a per-tensor checkpoint's
    shards, or its own quantization of its shard, the row-parallel layers' scales agreed over the
    ranks), and the greedy tokens equal one process's (the tiny random model is so sensitive that
    a scale one rounding apart changes its first token). PP = 2 with the FP8 KV cache too: each
    stage quantizes its own layers and keeps its layers' e4m3 cache."""
    from tests.test_hf_dir_models import _save_random_hf_model
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    _save_random_hf_model("llama3.1", False, tmp_path / "full")
    path, kw = str(tmp_path / "full"), {"quantization": "fp8"}
    if source == "checkpoint":
        _write_fp8_checkpoint(tmp_path / "full", tmp_path / "fp8", "compressed-tensors", "tensor")
        path, kw = str(tmp_path / "fp8"), {}
    if layout == "pp2+fp8-kv":
        kw["kv_cache_dtype"] = "fp8"
    parallel = {"tensor_parallel_size": 2} if layout == "tp2" else {"pipeline_parallel_size": 2}
    common = dict(dtype="float32", device="cpu", max_num_seqs=8, num_kv_blocks=128, **kw)
    prompts = [[(5 * i + 11 * j) % 500 + 1 for j in range(4 + 5 * i)] for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    want = [o.outputs[0].token_ids for o in LLM(path, **common).generate(prompts, greedy, use_tqdm=False)]
    llm = LLM(path, **parallel, **common)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want
    finally:
        llm.engine.close()
