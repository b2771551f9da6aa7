"""Mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE) from tiny random models saved
by HF transformers: tokenmill's logits are HF's; greedy tokens through the engine are HF's generate
for prompts of mixed lengths submitted together, with chunked prefill, preemption, n-gram
speculation and a grammar on one request, under sync and async scheduling; the fused 3D expert
layout loads as the per-expert one does; what MoE does not support yet is refused by name."""

import pytest
import torch

from tests.engine.conftest import assert_no_leaks, make_llm
from tests.helpers import full_logits
from tests.models.moe_helpers import EOS, FAMILIES, VOCAB, save_random_moe_model
from tokenmill.config import ConfigError, EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.errors import ModelLoadError
from tokenmill.loader import load_model
from tokenmill.models.config import arch_config_from_hf
from tokenmill.models.presets import get_preset
from tokenmill.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> (HF model, tokenmill's load of its directory, the directory)."""
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        hf = save_random_moe_model(family, path)
        out[family] = (hf, load_model(str(path), dtype="float32", device="cpu"), path)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hf(family, models):
    hf, loaded, _ = models[family]
    moe = loaded.arch.moe
    layers = [type(layer.mlp).__name__ for layer in loaded.model.model.layers]
    if family == "qwen3_moe":
        assert moe.renormalize and moe.dense_layers == (1,) and layers[1] == "LlamaMLP"
    if family == "qwen2_moe":
        assert not moe.renormalize and moe.shared_expert_intermediate_size == 48 and loaded.arch.qkv_bias
        assert layers == ["LlamaMLP", "SparseMoeBlock"] * 2
    if family == "mixtral":
        assert moe.renormalize and layers == ["SparseMoeBlock"] * 2
    if family == "olmoe":
        assert loaded.arch.qk_norm and not loaded.arch.qk_norm_per_head and loaded.arch.clip_qkv == 1.5
    assert loaded.arch.num_parameters() == sum(p.numel() for p in hf.parameters())
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (7, 40, 150)]
    ours = full_logits(loaded.model, seqs)
    for seq, logits in zip(seqs, ours):
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0].float()
        err = ((logits - ref).norm() / ref.norm()).item()
        assert err < 1e-4, f"{family}: relative error {err}"


NEW_TOKENS = 24
LETTERS = "abcdefghijklm"  # single-byte tokens, never merged (the tokenizer above)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
# Chunks of 16 prompt tokens; 10 blocks of 16 hold the longest request but not the batch (preemption).
BUSY = dict(max_num_batched_tokens=16, num_kv_blocks=10, speculative_config=NGRAM)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, EOS, (n,), generator=gen).tolist() for n in (5, 13, 29, 47, 70)]
    prompts[2] = prompts[2][:10] * 3  # repeats, so the n-gram drafter finds drafts in the prompt
    return prompts


class _OnlyTokens:
    """An HF logits processor that allows only the given tokens (the grammar's mask, for the reference)."""

    def __init__(self, allowed: list[int]):
        self.allowed = torch.tensor(allowed)

    def __call__(self, input_ids, scores):
        masked = torch.full_like(scores, float("-inf"))
        masked[:, self.allowed] = scores[:, self.allowed]
        return masked


@pytest.fixture(scope="module")
def hf_greedy(models):
    """family -> HF's greedy continuation of each prompt alone (EOS masked), and of the grammar
    request (only a..m allowed, as its regex allows)."""
    from transformers import LogitsProcessorList

    out = {}
    for family, (hf, _, _) in models.items():
        refs = []
        for ids in _prompts():
            with torch.no_grad():
                seq = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                  do_sample=False, pad_token_id=EOS)
            refs.append(seq[0, len(ids):].tolist())
        ids = _prompts()[3]
        letters = LogitsProcessorList([_OnlyTokens([ord(c) for c in LETTERS])])
        with torch.no_grad():
            seq = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=EOS,
                              logits_processor=letters)
        out[family] = refs, seq[0, len(ids):].tolist()
    return out


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("family", FAMILIES)
def test_busy_engine_greedy_matches_hf(family, async_scheduling, models, hf_greedy):
    _, loaded, _ = models[family]
    refs, grammar_ref = hf_greedy[family]
    llm = make_llm(loaded, async_scheduling=async_scheduling, **BUSY)
    prompts = _prompts()
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    grammar = SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                             structured_outputs={"regex": f"[{LETTERS[0]}-{LETTERS[-1]}]{{{NEW_TOKENS}}}"})
    outs = llm.generate(prompts + [prompts[3]], [greedy] * len(prompts) + [grammar], use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out.outputs[0].token_ids == ref, f"{family}: prompt {i} ({len(prompts[i])} tokens)"
    assert outs[-1].outputs[0].token_ids == grammar_ref
    assert len(outs[-1].outputs[0].text) == NEW_TOKENS and set(outs[-1].outputs[0].text) <= set(LETTERS)
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0 and engine.spec_stats.accepted > 0
    assert_no_leaks(llm)
    assert not engine.structured.matchers


def test_tensor_parallel_matches_hf(models, hf_greedy):
    """TP = 2 (gloo, one worker process) on OLMoE: each expert's intermediate dimension and the q
    norm over all heads split over the ranks, the k norm of its one KV head replicated; greedy
    tokens are still HF's."""
    from tokenmill.entrypoints.llm import LLM

    _, _, path = models["olmoe"]
    refs, _ = hf_greedy["olmoe"]
    llm = LLM(str(path), tensor_parallel_size=2, dtype="float32", device="cpu", num_kv_blocks=64, max_num_seqs=8)
    try:
        outs = llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS),
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == refs
        layer = llm.engine.loaded.model.model.layers[0]
        assert tuple(layer.mlp.experts.w13_weight.shape) == (8, 32, 64)  # 2 x 32 rows of 2 x 32, per rank
        assert tuple(layer.self_attn.q_norm.weight.shape) == (32,)  # half of q's 64 features
        assert tuple(layer.self_attn.k_norm.weight.shape) == (16,)  # all of k's, on both ranks
    finally:
        llm.engine.close()


def test_fused_expert_layout_loads(models, tmp_path):
    """transformers 5 holds experts fused ([E, 2I, H] gate_up_proj, [E, H, I] down_proj); a checkpoint
    in that layout (its in-memory state dict, with Mixtral's names as it holds them) loads into the
    same weights as the per-expert layout save_pretrained writes."""
    import shutil

    from safetensors.torch import save_file

    for family in ("mixtral", "qwen2_moe"):
        hf, per_expert, path = models[family]
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
        fused_dir = tmp_path / family
        fused_dir.mkdir()
        save_file(state, str(fused_dir / "model.safetensors"))
        shutil.copy(path / "config.json", fused_dir / "config.json")
        fused = load_model(str(fused_dir), dtype="float32", device="cpu")
        want = dict(per_expert.model.named_parameters())
        for name, p in fused.model.named_parameters():
            assert torch.equal(p, want[name]), f"{family}: {name}"


def test_lora_and_batch_invariance_refused(models):
    _, loaded, path = models["mixtral"]
    with pytest.raises(ConfigError, match="enable_lora.*mixture-of-experts.*MixtralForCausalLM"):
        LLMEngine(config=EngineConfig(enable_lora=True, num_kv_blocks=16), loaded=loaded)
    with pytest.raises(ConfigError, match="batch_invariant.*mixture-of-experts.*MixtralForCausalLM"):
        LLMEngine(str(path), EngineConfig(batch_invariant=True, num_kv_blocks=16), dtype="float32", device="cpu")


def test_fp8_refuses_experts(models):
    _, _, path = models["qwen3_moe"]
    with pytest.raises(ModelLoadError, match="Qwen3MoeForCausalLM.*'fp8'.*experts"):
        load_model(str(path), dtype="float32", device="cpu", quantization="fp8")


def test_config_fields_read_as_hf_reads_them():
    """Each family's quirks: where the expert count, expert width and renormalisation live, Qwen2-MoE's
    qkv_bias field, how each applies sliding_window."""
    base = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_experts_per_tok=2)
    qwen3 = arch_config_from_hf(dict(base, architectures=["Qwen3MoeForCausalLM"], num_local_experts=8,
                                     moe_intermediate_size=32, use_sliding_window=True, sliding_window=64))
    assert (qwen3.moe.num_experts, qwen3.moe.intermediate_size, qwen3.moe.renormalize, qwen3.sliding_window) == \
        (8, 32, False, 64)
    qwen2 = arch_config_from_hf(dict(base, architectures=["Qwen2MoeForCausalLM"], num_experts=4,
                                     moe_intermediate_size=32, shared_expert_intermediate_size=48, qkv_bias=False,
                                     norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[1]))
    assert not qwen2.qkv_bias and qwen2.moe.renormalize and qwen2.moe.shared_expert_intermediate_size == 48
    assert [qwen2.moe.is_sparse(i) for i in range(4)] == [False, False, False, True]
    assert arch_config_from_hf(dict(base, architectures=["Qwen2MoeForCausalLM"], num_experts=4,
                                    moe_intermediate_size=32)).qkv_bias  # HF's default
    mixtral = arch_config_from_hf(dict(base, architectures=["MixtralForCausalLM"], num_local_experts=4,
                                       norm_topk_prob=False, sliding_window=32))
    assert (mixtral.moe.intermediate_size, mixtral.moe.renormalize, mixtral.sliding_window) == (96, True, 32)
    olmoe = arch_config_from_hf(dict(base, architectures=["OlmoeForCausalLM"], num_experts=8, clip_qkv=8.0,
                                     sliding_window=32))
    assert (olmoe.clip_qkv, olmoe.qk_norm_per_head, olmoe.sliding_window) == (8.0, False, None)
    with pytest.raises(ModelLoadError, match="num_experts"):
        arch_config_from_hf(dict(base, architectures=["OlmoeForCausalLM"]))


def test_preset_parameter_counts():
    """Total and active parameters of the published shapes (Qwen3-30B-A3B: 30.5B / 3.3B; Mixtral
    8x7B: 46.7B / 12.9B)."""
    qwen = arch_config_from_hf(get_preset("qwen3-30b-a3b"))
    assert 30.4e9 < qwen.num_parameters() < 30.6e9 and 3.2e9 < qwen.num_active_parameters() < 3.4e9
    mixtral = arch_config_from_hf(get_preset("mixtral-8x7b"))
    assert 46.6e9 < mixtral.num_parameters() < 46.8e9 and 12.8e9 < mixtral.num_active_parameters() < 13.0e9
    dense = arch_config_from_hf(get_preset("llama-3.1-8b"))
    assert dense.num_active_parameters() == dense.num_parameters()
