"""Tiny random mixture-of-experts models of the four families, built and saved by HF transformers
(fp32, with a byte-level BPE tokenizer of exactly VOCAB tokens): shared by the MoE test files."""

import torch

VOCAB = 512
EOS = VOCAB - 1  # the tokenizer's one special token
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6, eos_token_id=EOS, bos_token_id=None, pad_token_id=EOS)


def hf_moe_config(family: str):
    import transformers as tf

    if family == "qwen3_moe":  # dense layer 1 (mlp_only_layers); renormalised top-k
        return tf.Qwen3MoeConfig(**COMMON, num_hidden_layers=3, head_dim=16, intermediate_size=96,
                                 moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                 mlp_only_layers=[1], rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if family == "qwen2_moe":  # sparse layers 1 and 3 (decoder_sparse_step 2), a shared expert, qkv bias
        return tf.Qwen2MoeConfig(**COMMON, num_hidden_layers=4, intermediate_size=96, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                                 norm_topk_prob=False, decoder_sparse_step=2)
    if family == "mixtral":
        return tf.MixtralConfig(**COMMON, num_hidden_layers=2, intermediate_size=32, num_local_experts=4,
                                num_experts_per_tok=2, sliding_window=None)
    if family == "olmoe":  # q/k norm over all heads; clip_qkv low enough to clip; one KV head (replicated at TP 2)
        return tf.OlmoeConfig(**{**COMMON, "num_key_value_heads": 1}, num_hidden_layers=2, intermediate_size=32, num_experts=8,
                              num_experts_per_tok=2, norm_topk_prob=False, clip_qkv=1.5)
    raise ValueError(family)


FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]


def _byte_chars() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (byte-level BPE vocabularies are written with it)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}


def save_byte_tokenizer(path) -> None:
    """A byte-level BPE tokenizer of exactly VOCAB tokens: the 256 bytes (id = byte), merges of
    letters n-z and digits only (so a-m are single-byte tokens), and <eos> last."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = _byte_chars()
    vocab = {chars[b]: b for b in range(256)}
    pool = "nopqrstuvwxyz0123456789"
    merges = [(a, b) for a in pool for b in pool][: VOCAB - 257]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    assert len(fast) == VOCAB and fast.eos_token_id == EOS
    fast.save_pretrained(path)


def save_random_moe_model(family: str, path, seed: int = 0):
    """The family's tiny HF model with every parameter random, saved with its tokenizer."""
    return save_random_model(hf_moe_config(family), path, seed)


def save_random_model(config, path, seed: int = 0):
    """HF's model of `config` with every parameter random (HF initialises norms to 1 and biases to
    0), saved with its tokenizer; the routers wider than the rest so that routing really varies by
    token."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                p.normal_(0.0, 0.3)
            elif name.endswith("self_attn.sinks"):  # gpt-oss: sinks that take a real share of the softmax
                p.normal_(0.0, 1.0)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.05)
    if getattr(config, "swiglu_limit", None) is not None:  # gpt-oss
        for module in model.modules():  # transformers up to 5.17 ignores the config's clamp (7.0 fixed)
            if hasattr(module, "limit") and hasattr(module, "alpha"):
                module.limit = config.swiglu_limit
    model.save_pretrained(path, safe_serialization=True)
    save_byte_tokenizer(path)
    return model.eval()
