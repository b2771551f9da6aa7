"""Tiny random models saved by HF transformers as safetensors directories give HF's logits in tokenmill."""

import pytest
import torch

from tests.helpers import full_logits
from tokenmill.loader import load_model

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)


def _config(kind: str, tied: bool):
    import transformers as tf

    if kind == "qwen3":
        return tf.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=tied, rope_theta=1e6)
    if kind == "qwen2":
        return tf.Qwen2Config(**COMMON, tie_word_embeddings=tied, rope_theta=1e6)
    if kind == "qwen2-yarn":  # positions past the original 32 take the interpolated frequencies
        rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 32}
        return tf.Qwen2Config(**COMMON, tie_word_embeddings=tied, rope_parameters=rope)
    if kind == "llama-yarn-mscale":  # DeepSeek's attention factor from the mscale pair, bounds not rounded
        rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0, "original_max_position_embeddings": 32,
                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707, "truncate": False}
        return tf.LlamaConfig(**COMMON, tie_word_embeddings=tied, rope_parameters=rope)
    if kind == "mistral":
        return tf.MistralConfig(**COMMON, tie_word_embeddings=tied, sliding_window=None)
    if kind == "llama3.1":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        return tf.LlamaConfig(**COMMON, tie_word_embeddings=tied, rope_parameters=rope)
    raise ValueError(kind)


def _save_random_hf_model(kind: str, tied: bool, path, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(kind, tied), dtype=torch.float32)
    with torch.no_grad():  # every parameter random (HF initialises norms to 1 and biases to 0)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.05)
    model.save_pretrained(path, safe_serialization=True)
    return model.eval()


CASES = [("qwen3", True), ("qwen3", False), ("qwen2", False), ("qwen2-yarn", True), ("llama-yarn-mscale", False),
         ("llama3.1", False), ("llama3.1", True), ("mistral", False)]


@pytest.mark.parametrize("kind,tied", CASES, ids=[f"{k}-{'tied' if t else 'untied'}" for k, t in CASES])
def test_logits_match_hf(kind, tied, tmp_path):
    hf = _save_random_hf_model(kind, tied, tmp_path)
    loaded = load_model(str(tmp_path), dtype="float32", device="cpu")
    assert loaded.arch.tie_word_embeddings == tied
    if kind.startswith("qwen2"):
        assert loaded.arch.qkv_bias
    if "yarn" in kind:
        assert loaded.arch.rope.kind == "yarn"
    if kind == "qwen3":
        assert loaded.arch.qk_norm
    if kind == "llama3.1":
        assert loaded.arch.rope.kind == "llama3"
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (7, 40, 150)]
    ours = full_logits(loaded.model, seqs)
    for seq, logits in zip(seqs, ours):
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0].float()
        err = ((logits - ref).norm() / ref.norm()).item()
        assert err < 1e-4, f"{kind}: relative error {err}"


def test_sharded_checkpoint_with_index(tmp_path):

    hf = _save_random_hf_model("qwen3", False, tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    one = load_model(str(tmp_path / "one"), dtype="float32", device="cpu")
    sharded = load_model(str(tmp_path / "sharded"), dtype="float32", device="cpu")
    for (name, a), (_, b) in zip(one.model.named_parameters(), sharded.model.named_parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_weights_arrive_in_target_dtype(dtype, tmp_path):
    _save_random_hf_model("llama3.1", False, tmp_path)
    loaded = load_model(str(tmp_path), dtype=dtype, device="cpu")
    assert all(p.dtype == getattr(torch, dtype) for p in loaded.model.parameters())
