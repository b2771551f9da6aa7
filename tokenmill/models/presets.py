"""Architecture presets for `--load-format dummy`: HF-style configs of well-known shapes."""

import copy

from tokenmill.errors import ModelLoadError

_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}

# What Llama 3.1's sizes share (8 KV heads of 128 dims, the 128k vocabulary and the llama3 rope).
_LLAMA31 = {
    "architectures": ["LlamaForCausalLM"], "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
    "tie_word_embeddings": False, "rope_theta": 500000.0, "rope_scaling": _LLAMA31_ROPE, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072, "eos_token_id": [128001, 128008, 128009], "bos_token_id": 128000,
    "torch_dtype": "bfloat16",
}

PRESETS: dict[str, dict] = {
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "intermediate_size": 3072,
        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "tie_word_embeddings": True, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960, "attention_bias": False, "eos_token_id": 151645, "bos_token_id": None,
        "torch_dtype": "bfloat16",
    },
    "llama-3.1-8b": {**_LLAMA31, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32},
    "llama-3.1-70b": {**_LLAMA31, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                      "num_attention_heads": 64},
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "vocab_size": 49152, "tie_word_embeddings": True, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192, "eos_token_id": 2, "bos_token_id": 1, "torch_dtype": "bfloat16",
    },
    # Mixture-of-experts shapes (for the bench's roofline and dummy-weight runs).
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "attention_bias": False,
        "eos_token_id": 151645, "bos_token_id": 151643, "torch_dtype": "bfloat16",
    },
    # Multi-GPU runs. From the published config: the shape, q/k norm (Qwen3MoeForCausalLM's),
    # norm_topk_prob and rope theta; assumed from the Qwen3 family and the released config as we
    # recall it: intermediate_size 12288 (unused: every layer is sparse), 40960 positions, eps 1e-6,
    # untied embeddings, the token ids.
    "qwen3-235b-a22b": {
        "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 4096, "intermediate_size": 12288,
        "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 94, "num_attention_heads": 64,
        "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "attention_bias": False,
        "eos_token_id": 151645, "bos_token_id": 151643, "torch_dtype": "bfloat16",
    },
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
        "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 32000, "tie_word_embeddings": False, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 32768, "sliding_window": None, "eos_token_id": 2,
        "bos_token_id": 1, "torch_dtype": "bfloat16",
    },
    # Phi-4-mini (3.8B). From the published config: the shape, partial_rotary_factor 0.75 (96 of 128
    # dims rotated), tied embeddings, LongRoPE with original 4096 / max 131072 positions. Assumed:
    # rope theta 10000, eps 1e-5, the token ids, sliding_window 262144 (longer than any context:
    # off) and the LongRoPE factors, placeholders of the right length (48) that only a dummy-weight
    # run sees (short 1.0, long 4.0; the attention factor follows from 131072 / 4096 as HF's does).
    "phi-4-mini": {
        "architectures": ["Phi3ForCausalLM"], "hidden_size": 3072, "intermediate_size": 8192,
        "num_hidden_layers": 32, "num_attention_heads": 24, "num_key_value_heads": 8, "vocab_size": 200064,
        "tie_word_embeddings": True, "partial_rotary_factor": 0.75, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "sliding_window": 262144,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [4.0] * 48},
        "eos_token_id": 199999, "bos_token_id": 199999, "torch_dtype": "bfloat16",
    },
    # Gemma 3 27B (text). From the published config as the brief states it: the shape, window 1024 on
    # five of every six layers, the global layers' rope theta 1M with linear scaling 8. Assumed:
    # query_pre_attn_scalar 168 (hidden / heads, as llama.cpp scales the 27B), local rope base 10000,
    # eps 1e-6, tied embeddings, 131072 positions, the token ids (<bos> 2, <eos> 1 and <end_of_turn> 106).
    "gemma-3-27b": {
        "architectures": ["Gemma3ForCausalLM"], "hidden_size": 5376, "intermediate_size": 21504,
        "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
        "vocab_size": 262208, "tie_word_embeddings": True, "query_pre_attn_scalar": 168, "sliding_window": 1024,
        "sliding_window_pattern": 6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072, "hidden_activation": "gelu_pytorch_tanh",
        "eos_token_id": [1, 106], "bos_token_id": 2, "torch_dtype": "bfloat16",
    },
    # gpt-oss-20b. From the published config: the shape (24 layers, 64 q / 8 KV heads of 64 dims, 32
    # experts of width 2880, top 4), window 128 on every other layer from layer 0, q/k/v/o biases, sinks,
    # rope theta 150000 with YaRN (factor 32, beta_fast 32, beta_slow 1, original 4096 positions, no
    # truncation), swiglu_limit 7, eps 1e-5, the token ids. The released weights' MXFP4 experts are
    # dequantized at load (models/gpt_oss.py); a dummy-weight run builds them in the model dtype.
    "gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"], "hidden_size": 2880, "intermediate_size": 2880,
        "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "num_local_experts": 32, "num_experts_per_tok": 4, "vocab_size": 201088, "tie_word_embeddings": False,
        "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12,
        "attention_bias": True, "swiglu_limit": 7.0, "rope_theta": 150000.0, "rms_norm_eps": 1e-5,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 4096, "truncate": False},
        "max_position_embeddings": 131072, "hidden_act": "silu", "eos_token_id": 200002, "pad_token_id": 199999,
        "bos_token_id": None, "torch_dtype": "bfloat16",
    },
    # DeepSeek-V2-Lite (15.7B, 2.4B active): multi-head latent attention (latent 512 + rope 64 per
    # token), 64 routed experts top 6 plus 2 shared, the first layer dense, YaRN to 160k positions.
    # From the published config as the brief states it; assumed from that config as we recall it: eps
    # 1e-6, rope theta 10000, greedy routing (n_group 1), no renormalisation, the token ids.
    "deepseek-v2-lite": {
        "architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 2048, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128, "v_head_dim": 128, "n_routed_experts": 64, "num_experts_per_tok": 6,
        "n_shared_experts": 2, "first_k_dense_replace": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
        "norm_topk_prob": False, "routed_scaling_factor": 1.0, "vocab_size": 102400, "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 163840,
        "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096},
        "hidden_act": "silu", "eos_token_id": 100001, "bos_token_id": 100000, "torch_dtype": "bfloat16",
    },
    # Small shapes for CPU tests and CI.
    "tiny-llama": {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "vocab_size": 1024, "tie_word_embeddings": False, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 2048, "eos_token_id": 2, "bos_token_id": 1, "torch_dtype": "float32",
    },
    # Qwen3-MoE in miniature (8 experts, top 2) for the MoE bench paths on the CPU.
    "tiny-qwen3-moe": {
        "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 128, "intermediate_size": 256,
        "moe_intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1024, "tie_word_embeddings": False,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "attention_bias": False,
        "eos_token_id": 2, "bos_token_id": None, "torch_dtype": "float32",
    },
    # DeepSeek-V3 in miniature (latent attention, q low-rank, sigmoid grouped routing) for CPU tests.
    "tiny-deepseek": {
        "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 128, "intermediate_size": 256,
        "moe_intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "kv_lora_rank": 64,
        "q_lora_rank": 48, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "vocab_size": 1024, "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048, "eos_token_id": 2,
        "bos_token_id": None, "torch_dtype": "float32",
    },
    "tiny-qwen3": {
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": 128, "intermediate_size": 384,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "vocab_size": 1024, "tie_word_embeddings": True, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048, "eos_token_id": 2, "bos_token_id": None, "torch_dtype": "float32",
    },
}


def get_preset(name: str) -> dict:
    key = name.lower()
    if key not in PRESETS:
        raise ModelLoadError(f"unknown architecture preset {name!r}; presets: {sorted(PRESETS)}")
    return copy.deepcopy(PRESETS[key])  # the presets share nested values (rope scaling, EOS ids)
