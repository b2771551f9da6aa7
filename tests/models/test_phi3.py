"""Phi-3 (Phi3ForCausalLM) from tiny random models saved by HF transformers: one Phi-3-like (LongRoPE,
full rotary, untied, a sliding window) and one Phi-4-mini-like (LongRoPE, partial rotary 0.75, tied
embeddings), both with fused qkv_proj / gate_up_proj tensors and original_max_position_embeddings
ORIG, so that sequences cross it.

tokenmill picks one LongRoPE factor set per engine (short when its context length is at most ORIG,
long otherwise; models/llama.py:build_rotary); HF picks per forward pass by the sequence's length.
So the short-context load is compared with HF on sequences up to ORIG and the long-context load on
longer ones: logits within 1e-4, and greedy tokens through a busy engine (chunked prefill,
preemption, n-gram speculation) equal HF's generate; TP = 2 loads the fused checkpoint alike."""

import dataclasses
import math

import pytest
import torch

from tests.engine.conftest import assert_no_leaks, make_llm
from tests.helpers import full_logits
from tests.models.moe_helpers import EOS, VOCAB, save_random_model
from tokenmill.config import ConfigError
from tokenmill.loader import load_model
from tokenmill.models.config import arch_config_from_hf
from tokenmill.models.llama import build_rotary
from tokenmill.models.phi3 import Phi3ForCausalLM
from tokenmill.models.presets import get_preset
from tokenmill.sampling_params import SamplingParams

ORIG = 48  # original_max_position_embeddings
MAX_POSITIONS = 256
KINDS = ["phi3", "phi4_mini"]


def hf_phi3_config(kind: str):
    import transformers as tf

    gen = torch.Generator().manual_seed(5)
    rotary_fraction = 1.0 if kind == "phi3" else 0.75
    pairs = int(16 * rotary_fraction) // 2  # head_dim 16
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": ORIG,
            "partial_rotary_factor": rotary_fraction,
            # factors far apart, so that using the wrong set shows in the logits
            "short_factor": (1 + torch.rand(pairs, generator=gen)).tolist(),
            "long_factor": (1 + 8 * torch.rand(pairs, generator=gen)).tolist()}
    common = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, num_hidden_layers=2, max_position_embeddings=MAX_POSITIONS,
                  original_max_position_embeddings=ORIG, rms_norm_eps=1e-5, eos_token_id=EOS, bos_token_id=None,
                  pad_token_id=EOS, rope_parameters=rope)
    if kind == "phi3":
        return tf.Phi3Config(**common, tie_word_embeddings=False, sliding_window=40)
    return tf.Phi3Config(**common, tie_word_embeddings=True, partial_rotary_factor=rotary_fraction,
                         sliding_window=None)


def save_random_phi3(kind: str, path):
    return save_random_model(hf_phi3_config(kind), path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind -> (HF model, tokenmill's load with context ORIG (short factors), with MAX_POSITIONS
    (long factors), the directory)."""
    out = {}
    for kind in KINDS:
        path = tmp_path_factory.mktemp(kind)
        hf = save_random_phi3(kind, path)
        short = load_model(str(path), dtype="float32", device="cpu", max_positions=ORIG)
        long = load_model(str(path), dtype="float32", device="cpu")
        out[kind] = hf, short, long, path
    return out


def test_config_read_as_hf_reads_it(models):
    from safetensors import safe_open

    for kind, (hf, short, long, path) in models.items():
        arch = short.arch
        assert isinstance(short.model, Phi3ForCausalLM) and arch.rope.kind == "longrope"
        assert arch.rope.original_max_position == ORIG
        assert arch.rope.attention_factor == pytest.approx(hf.model.rotary_emb.attention_scaling, rel=1e-12)
        assert arch.num_parameters() == sum(p.numel() for p in hf.parameters())
        names = set(safe_open(str(path / "model.safetensors"), "pt").keys())
        assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
        if kind == "phi3":
            assert (arch.rotary_dim, arch.sliding_window, arch.tie_word_embeddings) == (16, 40, False)
        else:
            assert (arch.rotary_dim, arch.sliding_window, arch.tie_word_embeddings) == (12, None, True)
            assert short.model.lm_head.weight is short.model.model.embed_tokens.weight
    # A hub config of the older layout: rope_scaling "su", the rotary fraction top-level, no factor
    # (HF's default: max / original positions).
    hub = dict(architectures=["Phi3ForCausalLM"], vocab_size=100, hidden_size=64, intermediate_size=96,
               num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=4096,
               original_max_position_embeddings=1024, partial_rotary_factor=0.5, sliding_window=2047,
               rope_scaling={"type": "su", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4})
    arch = arch_config_from_hf(hub)
    assert arch.rope.kind == "longrope" and arch.rotary_dim == 8 and arch.sliding_window == 2047
    assert arch.rope.attention_factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(1024)))


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_hf(kind, models):
    """Short-factor load on sequences up to ORIG, long-factor load on longer ones; the short factors
    on a long sequence are wrong (the switch matters)."""
    hf, short, long, _ = models[kind]
    gen = torch.Generator().manual_seed(1)
    for model, lengths in ((short.model, (7, 30, ORIG)), (long.model, (ORIG + 1, 100, 150))):
        seqs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]
        for seq, logits in zip(seqs, full_logits(model, seqs)):
            with torch.no_grad():
                ref = hf(torch.tensor([seq])).logits[0].float()
            err = ((logits - ref).norm() / ref.norm()).item()
            assert err < 1e-4, f"{kind}, {len(seq)} tokens: relative error {err}"
    seq = torch.randint(0, VOCAB, (100,), generator=gen).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0].float()
    wrong = _logits_with_short_factors(long, seq)
    assert ((wrong - ref).norm() / ref.norm()).item() > 1e-3  # 10 x the tolerance


def _logits_with_short_factors(loaded, seq: list[int]) -> torch.Tensor:
    """The long-context load's logits of `seq` with its table rebuilt from the short factors."""
    rope = dataclasses.replace(loaded.arch.rope, long_factor=loaded.arch.rope.short_factor)
    rotary = loaded.model.model.rotary
    saved = rotary.cos_sin_cache
    rotary.cos_sin_cache = build_rotary(dataclasses.replace(loaded.arch, rope=rope), MAX_POSITIONS, "cpu").cos_sin_cache
    try:
        return full_logits(loaded.model, [seq])[0]
    finally:
        rotary.cos_sin_cache = saved


NEW_TOKENS = 16
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def _prompts(context: str) -> list[list[int]]:
    """Mixed lengths, all within ORIG with their output (short context) or all past it (long)."""
    gen = torch.Generator().manual_seed(2)
    lengths = (5, 11, 20, 32) if context == "short" else (ORIG + 2, 60, 77, 95)
    prompts = [torch.randint(3, EOS, (n,), generator=gen).tolist() for n in lengths]
    prompts[2] = (prompts[2][:10] * 10)[: lengths[2]]  # repeats, so the n-gram drafter finds drafts
    return prompts


# context -> (max_model_len, engine options): chunks of 16 tokens, a KV cache too small for the batch.
ENGINES = {"short": (ORIG, dict(max_num_batched_tokens=16, num_kv_blocks=5, speculative_config=NGRAM)),
           "long": (MAX_POSITIONS, dict(max_num_batched_tokens=16, num_kv_blocks=12, speculative_config=NGRAM))}


@pytest.fixture(scope="module")
def hf_greedy(models):
    """(kind, context) -> HF generate's greedy continuation of each prompt (EOS never ends it). The
    prompts of one context go in one left-padded batch (the same tokens as one at a time): all of
    them, outputs included, are on the same side of ORIG, so HF's per-forward factor choice (by the
    batch's largest position) is each row's own."""
    out = {}
    for kind, (hf, _, _, _) in models.items():
        for context in ENGINES:
            prompts = _prompts(context)
            width = max(map(len, prompts))
            ids = torch.tensor([[EOS] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            with torch.no_grad():
                seqs = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                   do_sample=False, pad_token_id=EOS)
            out[kind, context] = seqs[:, width:].tolist()
    return out


@pytest.mark.parametrize("context", list(ENGINES))
@pytest.mark.parametrize("kind", KINDS)
def test_busy_engine_greedy_matches_hf(kind, context, models, hf_greedy):
    _, short, long, _ = models[kind]
    max_model_len, options = ENGINES[context]
    llm = make_llm(short if context == "short" else long, max_model_len=max_model_len, **options)
    prompts = _prompts(context)
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, hf_greedy[kind, context])):
        assert out.outputs[0].token_ids == ref, f"{kind}, {context}: prompt {i} ({len(prompts[i])} tokens)"
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0
    if context == "short":  # drafts come only where the model repeats itself; it does on these prompts
        assert engine.spec_stats.accepted > 0
    assert_no_leaks(llm)


def test_tensor_parallel_matches_hf(models, hf_greedy):
    """TP = 2 (gloo, one worker process) on the Phi-4-mini-like model: each rank takes its q, k, v
    (one KV head) and gate, up rows out of the fused tensors, in the rotary-first layout."""
    from tokenmill.entrypoints.llm import LLM

    path = models["phi4_mini"][3]
    llm = LLM(str(path), tensor_parallel_size=2, dtype="float32", device="cpu", num_kv_blocks=64, max_num_seqs=8)
    try:
        outs = llm.generate(_prompts("long"), SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                              min_tokens=NEW_TOKENS), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy["phi4_mini", "long"]
        layer = llm.engine.loaded.model.model.layers[0]
        assert tuple(layer.self_attn.qkv_proj.weight.shape) == (2 * 16 + 2 * 16, 64)  # 2 q heads, 1 k, 1 v
        assert tuple(layer.mlp.gate_up_proj.weight.shape) == (96, 64)  # half of gate, half of up
    finally:
        llm.engine.close()


def test_phi4_mini_preset():
    """The published shape: 3.8B parameters (tied embeddings), 96 of 128 dims rotated."""
    arch = arch_config_from_hf(get_preset("phi-4-mini"))
    assert arch.architecture == "Phi3ForCausalLM" and arch.rotary_dim == 96 and arch.tie_word_embeddings
    assert arch.rope.kind == "longrope" and arch.rope.original_max_position == 4096
    assert 3.8e9 < arch.num_parameters() < 3.9e9


def test_lora_refused(models):
    with pytest.raises(ConfigError, match="enable_lora: LoRA adapters on Phi3ForCausalLM"):
        make_llm(models["phi3"][1], max_model_len=ORIG, enable_lora=True)


def test_fp8_quantization_equals_dequantized_weights(models):
    """quantization="fp8" (per-row scales, after the fused tensors are split and q/k rows permuted) on
    the Phi-4-mini-like model: the same greedy tokens and prompt logprobs as the model carrying the
    dequantized weights."""
    from tests.quantization.test_fp8 import _assert_same_outputs
    from tokenmill.layers.linear import LinearBase
    from tokenmill.quantization.fp8 import dequantize_weight_fp8, quantize_weight_fp8

    path = str(models["phi4_mini"][3])
    quantized = load_model(path, dtype="float32", device="cpu", quantization="fp8")
    linears = [m for m in quantized.model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.weight.dtype == torch.float8_e4m3fn for m in linears)
    reference = load_model(path, dtype="float32", device="cpu")
    for m in reference.model.modules():
        if isinstance(m, LinearBase):
            m.weight.data.copy_(dequantize_weight_fp8(*quantize_weight_fp8(m.weight.data), torch.float32))
    prompts = _prompts("long")[:2] + _prompts("short")[:2]
    _assert_same_outputs(make_llm(quantized), make_llm(reference), prompts)
