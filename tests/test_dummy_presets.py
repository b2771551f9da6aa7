"""Dummy weights for the architecture presets: the shapes of BENCHMARKS.md, deterministic from a seed."""

import torch

from tokenmill.loader import load_model
from tokenmill.models.config import arch_config_from_hf
from tokenmill.models.presets import get_preset


def test_preset_shapes():
    qwen = arch_config_from_hf(get_preset("qwen3-0.6b"))
    assert (qwen.hidden_size, qwen.intermediate_size, qwen.num_layers, qwen.num_heads, qwen.num_kv_heads,
            qwen.head_dim, qwen.vocab_size, qwen.tie_word_embeddings, qwen.qk_norm) == \
        (1024, 3072, 28, 16, 8, 128, 151936, True, True)
    llama = arch_config_from_hf(get_preset("llama-3.1-8b"))
    assert (llama.hidden_size, llama.intermediate_size, llama.num_layers, llama.num_heads, llama.num_kv_heads,
            llama.vocab_size, llama.tie_word_embeddings, llama.rope.kind, llama.rope.theta) == \
        (4096, 14336, 32, 32, 8, 128256, False, "llama3", 500000.0)
    assert 7.9e9 < llama.num_parameters() < 8.1e9
    assert 0.59e9 < qwen.num_parameters() < 0.61e9
    big = arch_config_from_hf(get_preset("llama-3.1-70b"))
    assert (big.hidden_size, big.intermediate_size, big.num_layers, big.num_heads, big.num_kv_heads,
            big.head_dim, big.vocab_size, big.tie_word_embeddings, big.rope.kind) == \
        (8192, 28672, 80, 64, 8, 128, 128256, False, "llama3")
    assert 70.4e9 < big.num_parameters() < 70.7e9
    assert 0.13e9 < arch_config_from_hf(get_preset("smollm2-135m")).num_parameters() < 0.14e9


def test_dummy_weights_are_deterministic():
    a = load_model("tiny-qwen3", load_format="dummy", seed=3)
    b = load_model("tiny-qwen3", load_format="dummy", seed=3)
    c = load_model("tiny-qwen3", load_format="dummy", seed=4)
    pa, pb, pc = (dict(m.model.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not torch.equal(pa["model.embed_tokens.weight"], pc["model.embed_tokens.weight"])
    assert a.tokenizer is None


def test_moe_preset_shapes():
    """Qwen3-235B-A22B: 235B parameters, 22B active (8 of 128 experts on each of 94 layers)."""
    big = arch_config_from_hf(get_preset("qwen3-235b-a22b"))
    assert (big.hidden_size, big.num_layers, big.num_heads, big.num_kv_heads, big.head_dim, big.vocab_size,
            big.qk_norm, big.tie_word_embeddings, big.rope.theta) == (4096, 94, 64, 4, 128, 151936, True, False, 1e6)
    assert (big.moe.num_experts, big.moe.top_k, big.moe.intermediate_size, big.moe.renormalize) == (128, 8, 1536, True)
    assert all(big.moe.is_sparse(i) for i in range(94))
    assert 234.5e9 < big.num_parameters() < 235.5e9 and 21.8e9 < big.num_active_parameters() < 22.4e9
    tiny = arch_config_from_hf(get_preset("tiny-qwen3-moe"))
    assert (tiny.moe.num_experts, tiny.moe.top_k, tiny.num_layers) == (8, 2, 2)


def test_gpt_oss_preset_shape():
    """gpt-oss-20b: 20.9B parameters (OpenAI's figure), 3.6B active without the embedding."""
    arch = arch_config_from_hf(get_preset("gpt-oss-20b"))
    assert (arch.hidden_size, arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.vocab_size) == \
        (2880, 24, 64, 8, 64, 201088)
    assert (arch.moe.num_experts, arch.moe.top_k, arch.moe.intermediate_size, arch.moe.swiglu_limit) == (32, 4, 2880, 7.0)
    assert arch.sliding_layers == (True, False) * 12 and arch.sliding_window == 128
    assert arch.attention_sinks and arch.o_bias and arch.qkv_bias and arch.rope.theta == 150000.0
    assert (arch.rope.kind, arch.rope.factor, arch.rope.original_max_position, arch.rope.truncate) == \
        ("yarn", 32.0, 4096, False)
    assert 20.8e9 < arch.num_parameters() < 21.0e9
    assert 3.55e9 < arch.num_active_parameters() - arch.vocab_size * arch.hidden_size < 3.65e9
