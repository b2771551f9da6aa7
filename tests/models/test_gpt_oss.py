"""gpt-oss (GptOssForCausalLM) from a tiny random model saved by HF transformers: YaRN rope with the
released model's parameters, attention sinks, q/k/v/o biases, sliding (WINDOW tokens) and full layers interleaved, experts with biases and the clamped
SwiGLU (a limit low enough to bite on random weights), a biased router whose top-k logits are
softmaxed, and the checkpoint's interleaved gate/up layout; then the same model with MXFP4 experts
(`*_blocks` / `*_scales`, dequantized at load).

Logits within 1e-4 relative of HF's fp32 on prompts shorter and longer than the window, and greedy
tokens through a busy engine (mixed lengths, chunked prefill, preemption) equal to HF's generate."""

import copy
import json
import shutil

import pytest
import torch

from tests.engine.conftest import assert_no_leaks, make_llm
from tests.helpers import full_logits
from tests.models.moe_helpers import EOS, VOCAB, save_random_model
from tokenmill.loader import load_model
from tokenmill.models.gpt_oss import GptOssForCausalLM
from tokenmill.sampling_params import SamplingParams

WINDOW = 8
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
NEW_TOKENS = 16
# gpt-oss's released rope scaling
YARN = dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=4096, truncate=False)


def hf_gpt_oss_config():
    import transformers as tf

    return tf.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=32, num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES, sliding_window=WINDOW,
        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256, rms_norm_eps=1e-5,
        eos_token_id=EOS, bos_token_id=None, pad_token_id=EOS, swiglu_limit=0.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, **YARN},
        attn_implementation="eager")  # the sinks are in HF's eager attention (older versions chose SDPA)


def _to_mxfp4(hf, src, dst):
    """dst: src's checkpoint with every expert projection replaced by random MXFP4 blocks and scales
    (and quantization_config mxfp4); hf's experts set to transformers' own dequantization of them."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    gen = torch.Generator().manual_seed(7)
    for name in [n for n in tensors if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
        e, k, n = tensors.pop(name).shape  # HF holds [E, K, N]; the checkpoint stores [E, N, K / 32, 16]
        blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(127 - 6, 127 - 3, (e, n, k // 32), generator=gen, dtype=torch.uint8)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        with torch.no_grad():
            hf.get_parameter(name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind ("dense": the checkpoint as HF saves it, "mxfp4": its experts in MXFP4) -> (HF model,
    tokenmill's load, the checkpoint's directory)."""
    path = tmp_path_factory.mktemp("gpt_oss")
    hf = save_random_model(hf_gpt_oss_config(), path)
    out = {"dense": (hf, load_model(str(path), dtype="float32", device="cpu"), path)}
    hf_q, path_q = copy.deepcopy(hf), path.parent / (path.name + "_mxfp4")
    _to_mxfp4(hf_q, path, path_q)
    out["mxfp4"] = hf_q, load_model(str(path_q), dtype="float32", device="cpu"), path_q
    return out


def test_config_read_as_hf_reads_it(models):
    hf, loaded, _ = models["dense"]
    arch, model = loaded.arch, loaded.model
    assert isinstance(model, GptOssForCausalLM)
    assert arch.num_parameters() == sum(p.numel() for p in hf.parameters())
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [WINDOW, None, WINDOW]
    assert arch.rope.theta == 150000.0 and arch.attention_sinks and arch.o_bias and arch.qkv_bias
    assert (arch.rope.kind, arch.rope.factor, arch.rope.original_max_position, arch.rope.truncate) == \
        ("yarn", 32.0, 4096, False)
    assert (arch.moe.bias, arch.moe.swiglu_limit, arch.moe.swiglu_alpha, arch.moe.renormalize) == (True, 0.5, 1.702, True)
    layer = model.model.layers[0]
    torch.testing.assert_close(layer.self_attn.attn.sinks, hf.model.layers[0].self_attn.sinks, rtol=0, atol=0)
    experts = hf.model.layers[0].mlp.experts
    torch.testing.assert_close(layer.mlp.experts.w13_weight[1, :32], experts.gate_up_proj[1, :, ::2].T, rtol=0, atol=0)
    torch.testing.assert_close(layer.mlp.experts.w13_bias[1, 32:], experts.gate_up_proj_bias[1, 1::2], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["dense", "mxfp4"])
def test_logits_match_hf(kind, models):
    """Shorter and longer than the window (and than a KV block), in one batch."""
    hf, loaded, _ = models[kind]
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, WINDOW, 30, 70)]
    for seq, logits in zip(seqs, full_logits(loaded.model, seqs)):
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0].float()
        err = ((logits - ref).norm() / ref.norm()).item()
        assert err < 1e-4, f"{kind}, {len(seq)} tokens: relative error {err}"


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(3, EOS, (n,), generator=gen).tolist() for n in (5, 11, 20, 37)]


@pytest.fixture(scope="module")
def hf_greedy(models) -> list[list[int]]:
    """HF generate's greedy continuation of each prompt, one at a time."""
    hf = models["dense"][0]
    refs = []
    for prompt in _prompts():
        with torch.no_grad():
            seq = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, pad_token_id=EOS)
        refs.append(seq[0, len(prompt):].tolist())
    return refs


def test_busy_engine_greedy_matches_hf(models, hf_greedy):
    """Chunks of 16 tokens, a KV cache too small for the batch (preemption), prompts shorter and
    longer than the window; HF's generate one prompt at a time."""
    _, loaded, _ = models["dense"]
    refs = hf_greedy
    llm = make_llm(loaded, max_model_len=64, max_num_batched_tokens=16, num_kv_blocks=5)
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outs = llm.generate(_prompts(), greedy, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out.outputs[0].token_ids == ref, f"prompt {i}"
    assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leaks(llm)


# TP 2 with EP splits the attention heads (and sinks) as plain TP 2 does; the experts' width split of
# plain TP is the other MoE families' (tests/models/test_moe_families.py::test_tensor_parallel_matches_hf).
@pytest.mark.parametrize("expert_parallel", [True], ids=["tp2-ep"])
def test_tensor_parallel_matches_hf(models, hf_greedy, expert_parallel):
    """TP = 2 (gloo, one worker process): the sinks split by q head with the heads; without expert
    parallelism each expert's gate/up bias split with its rows and the down bias added once (rank
    0's); with it, two whole experts (and their biases) per rank. Greedy tokens are still HF's."""
    from tokenmill.entrypoints.llm import LLM

    llm = LLM(str(models["dense"][2]), tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
              dtype="float32", device="cpu", num_kv_blocks=64, max_num_seqs=8)
    try:
        outs = llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS),
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy
        layer = llm.engine.loaded.model.model.layers[0]
        assert tuple(layer.self_attn.attn.sinks.shape) == (2,)  # 2 of the 4 q heads
        experts = layer.mlp.experts
        assert tuple(experts.w13_bias.shape) == ((2, 64) if expert_parallel else (4, 32))
    finally:
        llm.engine.close()


def test_warm_up_compiles_both_layer_kinds_with_sinks(models, monkeypatch):
    """Warm-up launches every attention variant for the sliding layers' window and for the full
    layers, each with the sinks (a variant first met under load would compile on the step path)."""
    from tokenmill.runner import warmup

    llm = make_llm(models["dense"][1], max_model_len=64)
    spec = llm.engine.runner.attn_spec
    assert spec.sinks and spec.layer_windows == (WINDOW, None)
    seen = []
    monkeypatch.setattr(warmup, "paged_attention", lambda *a, **kw: seen.append((kw["sliding_window"], kw["sinks"])))
    assert warmup.warm_up_attention(llm.engine.runner) == len(seen) > 0
    assert {w for w, _ in seen} == {WINDOW, None} and all(s is not None and s.shape == (4,) for _, s in seen)


def test_refused_options(models):
    from tokenmill.config import ConfigError
    from tokenmill.errors import ModelLoadError

    _, loaded, dense_dir = models["dense"]
    with pytest.raises(ConfigError, match="enable_lora"):
        make_llm(loaded, max_model_len=64, enable_lora=True)
    with pytest.raises(ConfigError, match="batch_invariant: GptOssForCausalLM's attention sinks"):
        make_llm(loaded, max_model_len=64, batch_invariant=True)
    with pytest.raises(ModelLoadError, match="MXFP4 experts are dequantized at load"):
        load_model(str(models["mxfp4"][2]), dtype="float32", device="cpu", quantization="fp8")
    with pytest.raises(ModelLoadError, match="run unquantized only"):  # FP8 experts have no biases yet
        load_model(str(dense_dir), dtype="float32", device="cpu", quantization="fp8")


def test_hub_config_read_as_hf_reads_it():
    """The released gpt-oss-20b config.json's layout (rope_scaling yarn beside rope_theta, MXFP4
    quantization_config, no layer_types): the layer kinds, rope and experts HF's config class makes
    of it, and an MXFP4 quantization_config that loads as a full-precision model."""
    import transformers as tf

    from tokenmill.loader.quantize import resolve_quantization
    from tokenmill.models.config import arch_config_from_hf

    hub = {"architectures": ["GptOssForCausalLM"], "attention_bias": True, "eos_token_id": 200002,
           "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
           "initial_context_length": 4096, "intermediate_size": 2880, "max_position_embeddings": 131072,
           "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
           "num_key_value_heads": 8, "num_local_experts": 32, "pad_token_id": 199999,
           "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]},
           "rms_norm_eps": 1e-05, "rope_scaling": {"rope_type": "yarn", **YARN}, "rope_theta": 150000,
           "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False, "vocab_size": 201088}
    arch = arch_config_from_hf(hub)
    hf = tf.GptOssConfig(**{k: v for k, v in hub.items() if k not in ("architectures", "quantization_config")})
    assert arch.sliding_layers == tuple(kind == "sliding_attention" for kind in hf.layer_types)
    rope = hf.rope_parameters
    assert (arch.rope.kind, arch.rope.factor, arch.rope.theta, arch.rope.truncate) == \
        (rope["rope_type"], rope["factor"], rope["rope_theta"], rope["truncate"])
    assert (arch.moe.num_experts, arch.moe.top_k, arch.moe.swiglu_limit) == (32, 4, hf.swiglu_limit)
    assert resolve_quantization(None, hub) is None
