"""Gemma 3 text and Gemma 2 from tiny random models saved by HF transformers: sliding and global
layers interleaved with a window of WINDOW tokens (Gemma 3: its own rotary base on the sliding layers
and linear scaling on the global ones, q/k norm; Gemma 2: attention and final logit soft-capping),
an attention scale from query_pre_attn_scalar unlike head_dim ** -0.5, (1 + w) norms with random w.

Logits within 1e-4 relative of HF's fp32 on prompts shorter and longer than the window, and greedy
tokens through a busy engine (mixed lengths, chunked prefill, preemption) equal to HF's generate with
its default cache (for Gemma, sliding-window layers keep only the window: the same as full attention
masked by the window, which is what tokenmill computes over full KV blocks)."""

import pytest
import torch

from tests.engine.conftest import assert_no_leaks, make_llm
from tests.helpers import full_logits
from tests.models.moe_helpers import EOS, VOCAB, save_random_model
from tokenmill.loader import load_model
from tokenmill.models.gemma import GemmaForCausalLM
from tokenmill.sampling_params import SamplingParams

WINDOW = 8
MAX_POSITIONS = 256
KINDS = ["gemma3", "gemma2"]
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def hf_gemma_config(kind: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=96, num_hidden_layers=len(LAYER_TYPES), max_position_embeddings=MAX_POSITIONS,
                  rms_norm_eps=1e-6, eos_token_id=EOS, bos_token_id=None, pad_token_id=EOS, sliding_window=WINDOW,
                  query_pre_attn_scalar=24, tie_word_embeddings=True)
    if kind == "gemma3":
        rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
        return tf.Gemma3TextConfig(**common, layer_types=LAYER_TYPES, rope_parameters=rope)
    # Gemma 2's default alternation (sliding, global, ...); caps small enough to bite on random weights
    return tf.Gemma2Config(**common, attn_logit_softcapping=1.5, final_logit_softcapping=4.0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind -> (HF model, tokenmill's load)."""
    out = {}
    for kind in KINDS:
        path = tmp_path_factory.mktemp(kind)
        hf = save_random_model(hf_gemma_config(kind), path)
        out[kind] = hf, load_model(str(path), dtype="float32", device="cpu")
    return out


def test_config_read_as_hf_reads_it(models):
    for kind, (hf, loaded) in models.items():
        arch, model = loaded.arch, loaded.model
        assert isinstance(model, GemmaForCausalLM)
        assert arch.num_parameters() == sum(p.numel() for p in hf.parameters())
        windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
        scales = {layer.self_attn.attn.scale for layer in model.model.layers}
        assert scales == {24 ** -0.5}
        if kind == "gemma3":
            assert windows == [WINDOW if t == "sliding_attention" else None for t in LAYER_TYPES]
            assert arch.rope.kind == "linear" and arch.rope.factor == 8.0 and arch.local_rope.theta == 10_000.0
            assert model.model.layers[2].self_attn.rotary is model.model.rotary
            assert model.model.layers[0].self_attn.rotary is model.model.local_rotary
        else:
            assert windows == [WINDOW, None, WINDOW, None]
            assert (arch.attn_logit_softcap, arch.final_logit_softcap) == (1.5, 4.0)


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_hf(kind, models):
    """Shorter and longer than the window (and than a KV block), in one batch."""
    hf, loaded = models[kind]
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, WINDOW, 30, 100)]
    for seq, logits in zip(seqs, full_logits(loaded.model, seqs)):
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0].float()
        err = ((logits - ref).norm() / ref.norm()).item()
        assert err < 1e-4, f"{kind}, {len(seq)} tokens: relative error {err}"


NEW_TOKENS = 16


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(3, EOS, (n,), generator=gen).tolist() for n in (5, 11, 20, 37)]


@pytest.fixture(scope="module")
def hf_greedy(models):
    """kind -> HF generate's greedy continuation of each prompt, one at a time (its default cache)."""
    out = {}
    for kind, (hf, _) in models.items():
        conts = []
        for prompt in _prompts():
            with torch.no_grad():
                seq = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                  do_sample=False, pad_token_id=EOS)
            conts.append(seq[0, len(prompt):].tolist())
        out[kind] = conts
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_busy_engine_greedy_matches_hf(kind, models, hf_greedy):
    """Chunks of 16 tokens, a KV cache too small for the batch (preemption)."""
    llm = make_llm(models[kind][1], max_model_len=64, max_num_batched_tokens=16, num_kv_blocks=5)
    prompts = _prompts()
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, hf_greedy[kind])):
        assert out.outputs[0].token_ids == ref, f"{kind}: prompt {i} ({len(prompts[i])} tokens)"
    assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leaks(llm)


def test_gemma3_27b_preset_read_as_hf_reads_it():
    """The hub layout (rope_theta + rope_scaling for the global layers, rope_local_base_freq,
    sliding_window_pattern): the same layer kinds and rotary as HF's config class makes of it; 27B."""
    import transformers as tf

    from tokenmill.models.config import arch_config_from_hf
    from tokenmill.models.presets import get_preset

    preset = get_preset("gemma-3-27b")
    arch = arch_config_from_hf(preset)
    hf = tf.Gemma3TextConfig(**{k: v for k, v in preset.items() if k not in ("architectures", "torch_dtype")})
    assert arch.sliding_layers == tuple(kind == "sliding_attention" for kind in hf.layer_types)
    full, local = hf.rope_parameters["full_attention"], hf.rope_parameters["sliding_attention"]
    assert (arch.rope.kind, arch.rope.factor, arch.rope.theta) == (full["rope_type"], full["factor"], full["rope_theta"])
    assert (arch.local_rope.kind, arch.local_rope.theta) == (local["rope_type"], local["rope_theta"])
    assert arch.attn_scale == hf.query_pre_attn_scalar ** -0.5
    assert 26.9e9 < arch.num_parameters() < 27.1e9


def test_refused_options(models):
    from tokenmill.config import ConfigError

    with pytest.raises(ConfigError, match="enable_lora: LoRA adapters on Gemma3ForCausalLM"):
        make_llm(models["gemma3"][1], max_model_len=64, enable_lora=True)
    with pytest.raises(ConfigError, match="batch_invariant: Gemma2ForCausalLM's attention soft-capping"):
        make_llm(models["gemma2"][1], max_model_len=64, batch_invariant=True)


def test_gemma3_conditional_generation_checkpoint_serves_its_language_model(tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint (vision tower, projector, the text model under
    language_model.*) loads as its text model: the vision weights skipped, text logits equal to HF's."""
    import transformers as tf

    vision = tf.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   image_size=16, patch_size=8)
    config = tf.Gemma3Config(text_config=hf_gemma_config("gemma3").to_dict(), vision_config=vision.to_dict(),
                             mm_tokens_per_image=4, boi_token_index=1, eoi_token_index=2, image_token_index=3)
    hf = save_random_model(config, tmp_path)
    assert type(hf).__name__ == "Gemma3ForConditionalGeneration"
    loaded = load_model(str(tmp_path), dtype="float32", device="cpu")
    assert isinstance(loaded.model, GemmaForCausalLM) and loaded.arch.architecture == "Gemma3ForCausalLM"
    seq = torch.randint(4, VOCAB, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([seq])).logits[0].float()
    logits = full_logits(loaded.model, [seq])[0]
    assert ((logits - ref).norm() / ref.norm()).item() < 1e-4


def test_hub_conditional_generation_config_takes_hf_text_defaults():
    """Hub Gemma 3 4B's config.json names only what differs from Gemma3TextConfig's defaults."""
    import transformers as tf

    from tokenmill.models.config import arch_config_from_hf

    text = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}
    arch = arch_config_from_hf({"architectures": ["Gemma3ForConditionalGeneration"], "text_config": text,
                                "eos_token_id": [1, 106], "model_type": "gemma3"})
    hf = tf.Gemma3Config(text_config=text).text_config
    assert (arch.vocab_size, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.sliding_window) == \
        (hf.vocab_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim, hf.sliding_window)
    assert arch.sliding_layers == tuple(kind == "sliding_attention" for kind in hf.layer_types)
    assert (arch.rope.theta, arch.local_rope.theta) == (hf.rope_parameters["full_attention"]["rope_theta"],
                                                        hf.rope_parameters["sliding_attention"]["rope_theta"])
    assert arch.attn_scale == hf.query_pre_attn_scalar ** -0.5 and arch.eos_token_ids == [1, 106]
