"""DeepSeek-V2 and DeepSeek-V3 from tiny random models saved by HF transformers (fp32): multi-head
latent attention over a latent KV cache, grouped routing (V2: softmax, group_limited_greedy; V3:
sigmoid with a random e_score_correction_bias, renormalised), shared experts, a dense first layer,
V2's q_proj and V3's low-rank q, interleaved rope, routed_scaling_factor != 1; V2 with DeepSeek-V2-Lite's
YaRN rope scaling (factor 40, mscale = mscale_all_dim = 0.707: the softmax scale times mscale ** 2).

Logits within 1e-4 relative of HF's for the expanded prefill path (one batch of mixed lengths) and
for the absorbed latent decode path (one decode step after a prefill); greedy tokens through a busy
engine (mixed lengths together, chunked prefill, preemption: decode steps absorbed, prefill and mixed
steps expanded) equal to HF's generate, also under tensor parallelism (heads split over 2 ranks); V3's
multi-token-prediction layer skipped at load; a prefix-cache hit; the latent cache's size; the V2-Lite preset's parameter
count; dummy weights; what is not supported refused by name."""

import logging
import math

import pytest
import torch

from tests.engine.conftest import assert_no_leaks, make_llm
from tests.helpers import full_logits, scratch_kv_caches
from tests.models.moe_helpers import EOS, VOCAB, save_random_model
from tokenmill.config import ConfigError, EngineConfig
from tokenmill.kernels.fused_moe import GroupedTopK, moe_route_grouped_ref
from tokenmill.layers.forward_context import AttentionMetadata, forward_context
from tokenmill.loader import load_model
from tokenmill.models.deepseek import DeepseekForCausalLM
from tokenmill.sampling_params import SamplingParams

KINDS = ["v2", "v3"]
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_hidden_layers=3, intermediate_size=96,
              moe_intermediate_size=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
              n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=4,
              topk_group=2, max_position_embeddings=256, rms_norm_eps=1e-6, eos_token_id=EOS, bos_token_id=None,
              pad_token_id=EOS)

# DeepSeek-V2-Lite's rope scaling, as its config.json has it
V2_LITE_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, beta_fast=32, beta_slow=1, mscale=0.707,
                    mscale_all_dim=0.707, original_max_position_embeddings=4096)


def hf_deepseek_config(kind: str):
    import transformers as tf

    if kind == "v2":  # V2-Lite's q_proj and YaRN; group-limited greedy routing
        return tf.DeepseekV2Config(**COMMON, q_lora_rank=None, topk_method="group_limited_greedy",
                                   routed_scaling_factor=1.5, rope_parameters=V2_LITE_YARN)
    return tf.DeepseekV3Config(**COMMON, q_lora_rank=24, routed_scaling_factor=2.5, norm_topk_prob=True)


def _add_mtp_layer(path, num_layers: int) -> None:
    """Give the checkpoint a multi-token-prediction layer's tensors, as V3's hub checkpoints have."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    tensors[f"model.layers.{num_layers}.enorm.weight"] = torch.ones(COMMON["hidden_size"])
    tensors[f"model.layers.{num_layers}.self_attn.kv_b_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind -> (HF model, tokenmill's load, the directory)."""
    out = {}
    for kind in KINDS:
        path = tmp_path_factory.mktemp(kind)
        hf = save_random_model(hf_deepseek_config(kind), path)
        if kind == "v3":  # a bias that changes the choice (HF initialises it to zero)
            with torch.no_grad():
                for layer in hf.model.layers[COMMON["first_k_dense_replace"]:]:
                    layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.2)
            hf.save_pretrained(path)
            _add_mtp_layer(path, COMMON["num_hidden_layers"])
        out[kind] = hf, load_model(str(path), dtype="float32", device="cpu"), path
    return out


def test_config_read_as_hf_reads_it(models):
    for kind, (hf, loaded, _) in models.items():
        arch, model = loaded.arch, loaded.model
        assert isinstance(model, DeepseekForCausalLM)
        assert arch.num_parameters() == sum(p.numel() for p in hf.parameters())
        mla, moe = arch.mla, arch.moe
        assert (mla.kv_lora_rank, mla.qk_rope_head_dim, mla.q_lora_rank) == (32, 8, None if kind == "v2" else 24)
        mscale = 0.1 * 0.707 * math.log(40.0) + 1.0 if kind == "v2" else 1.0
        scales = {layer.self_attn.attn.scale for layer in model.model.layers}
        assert len(scales) == 1 and scales.pop() == pytest.approx(24 ** -0.5 * mscale ** 2, rel=1e-12)
        assert arch.rope.kind == ("yarn" if kind == "v2" else "default")
        assert moe.dense_layers == (0,) and moe.shared_expert_intermediate_size == 32 and not moe.shared_expert_gated
        assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["LlamaMLP", "DeepseekMoE", "DeepseekMoE"]
        if kind == "v2":
            assert (moe.scoring, moe.group_score, moe.renormalize, moe.routed_scaling_factor) == ("softmax", "max",
                                                                                                    False, 1.5)
        else:
            assert (moe.scoring, moe.group_score, moe.renormalize, moe.score_correction_bias) == ("sigmoid",
                                                                                                  "top2_sum", True, True)
            bias = model.model.layers[1].mlp.experts.e_score_correction_bias
            assert torch.equal(bias, hf.model.layers[1].mlp.gate.e_score_correction_bias)
        spec = model.attention_spec()
        assert spec.latent and (spec.num_kv_heads, spec.head_dim) == (1, 40)


def test_grouped_routing_matches_hf_routers(models):
    """moe_route_grouped_ref against HF's own router modules (V2 softmax group-limited, V3 sigmoid +
    bias), and the plain softmax top-k against V2's greedy router (V2-Lite's)."""
    for kind, (hf, loaded, _) in models.items():
        router, moe = hf.model.layers[1].mlp.gate, loaded.arch.moe
        x = torch.randn(50, COMMON["hidden_size"], generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            logits, ref_w, ref_ids = router(x)
        bias = getattr(router, "e_score_correction_bias", None)
        grouping = GroupedTopK(moe.scoring, moe.num_groups, moe.topk_groups, moe.group_score,
                               moe.routed_scaling_factor)
        weights, ids = moe_route_grouped_ref(logits, moe.top_k, moe.renormalize, grouping, bias)
        ref_ids, order = ref_ids.sort(dim=-1)
        ids, mine = ids.long().sort(dim=-1)
        assert torch.equal(ids, ref_ids), kind
        torch.testing.assert_close(weights.gather(1, mine), ref_w.gather(1, order), rtol=1e-6, atol=1e-7)
    # V2-Lite's routing (greedy, scale 1): FusedMoE's plain softmax top-k, unrenormalised
    import transformers as tf
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    from tokenmill.kernels.fused_moe import moe_route

    config = tf.DeepseekV2Config(**COMMON, topk_method="greedy", routed_scaling_factor=1.0)
    router = DeepseekV2TopkRouter(config)
    with torch.no_grad():
        router.weight.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(7))
        logits, ref_w, ref_ids = router(x)
    weights, ids = moe_route(logits, 2, False)
    ref_ids, order = ref_ids.sort(dim=-1)
    ids, mine = ids.long().sort(dim=-1)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights.gather(1, mine), ref_w.gather(1, order), rtol=1e-6, atol=1e-7)


def _relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_logits_match_hf(kind, models):
    """The expanded path: every position of sequences shorter and longer than a KV block, one batch."""
    hf, loaded, _ = models[kind]
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 16, 40)]
    for seq, logits in zip(seqs, full_logits(loaded.model, seqs)):
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0].float()
        assert _relative_error(logits, ref) < 1e-4, f"{kind}, {len(seq)} tokens"


def test_prefill_in_query_slices_matches_hf(models, monkeypatch):
    """The expanded path over slices of a chunk's queries (each slice seeing the keys up to its last
    query), as it runs when heads x queries x keys would exceed SCORES_BUDGET: 7 queries a slice here."""
    from tokenmill.layers import mla

    hf, loaded, _ = models["v3"]
    monkeypatch.setattr(mla, "SCORES_BUDGET", 4 * 7 * 40)  # 4 heads, the 40-token sequence: 7 queries
    seq = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(8)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0].float()
    assert _relative_error(full_logits(loaded.model, [seq])[0], ref) < 1e-4


@torch.no_grad()
def _last_step_logits(model, sequences: list[list[int]], last: list[int], block_size: int = 16) -> torch.Tensor:
    """Prefill all but the last `last[i]` tokens of each sequence, then one step of those tokens
    together (all 1: a decode step, max_query_len 1; else a mixed step); returns the logits of each
    sequence's final token in that step [B, vocab]."""
    blocks = [-(-len(s) // block_size) for s in sequences]
    caches = scratch_kv_caches(model, sum(blocks) + 1, block_size)
    tables = torch.zeros(len(sequences), max(blocks), dtype=torch.int32)
    first = 1
    for i, n in enumerate(blocks):
        tables[i, :n] = torch.arange(first, first + n)
        first += n

    def step(chunks: list[list[int]], starts: list[int]) -> torch.Tensor:
        ids, positions, slots, qsl = [], [], [], [0]
        for i, (chunk, start) in enumerate(zip(chunks, starts)):
            for p in range(start, start + len(chunk)):
                positions.append(p)
                slots.append(int(tables[i, p // block_size]) * block_size + p % block_size)
            ids += chunk
            qsl.append(qsl[-1] + len(chunk))
        seq_lens = [s + len(c) for c, s in zip(chunks, starts)]
        meta = AttentionMetadata(torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
                                 tables, torch.tensor(slots), max_query_len=max(len(c) for c in chunks),
                                 max_seq_len=max(seq_lens))
        with forward_context(meta, caches):
            hidden = model(torch.tensor(ids), torch.tensor(positions))
        return model.compute_logits(hidden[torch.tensor(qsl[1:]) - 1])

    step([s[:-n] for s, n in zip(sequences, last)], [0] * len(sequences))
    return step([s[-n:] for s, n in zip(sequences, last)], [len(s) - n for s, n in zip(sequences, last)])


@pytest.mark.parametrize("last", [[1, 1, 1], [1, 6, 1]], ids=["decode", "mixed"])
@pytest.mark.parametrize("kind", KINDS)
def test_decode_logits_match_hf(kind, last, models):
    """The absorbed path (W_UK in the query, attention over the cached latents, W_UV after): a decode
    step, and a mixed step whose one-token requests take it beside a 6-token chunk's expanded path."""
    hf, loaded, _ = models[kind]
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (3, 17, 45)]
    ours = _last_step_logits(loaded.model, seqs, last)
    for seq, logits in zip(seqs, ours):
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0, -1].float()
        assert _relative_error(logits, ref) < 1e-4, f"{kind}, {len(seq)} tokens"


NEW_TOKENS = 12


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(3, EOS, (n,), generator=gen).tolist() for n in (5, 11, 23, 37)]


@pytest.fixture(scope="module")
def hf_greedy(models):
    """kind -> HF generate's greedy continuation of each prompt alone."""
    out = {}
    for kind, (hf, _, _) in models.items():
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
    """Chunks of 16 tokens, a KV cache too small for the batch (preemption); the latent cache's size."""
    llm = make_llm(models[kind][1], max_model_len=64, max_num_batched_tokens=16, num_kv_blocks=5)
    runner = llm.engine.runner
    mla = models[kind][1].arch.mla
    assert runner.kv_spec.planes == 1 and runner.kv_spec.bytes_per_token == 3 * mla.cache_width * 4
    prompts = _prompts()
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, hf_greedy[kind])):
        assert out.outputs[0].token_ids == ref, f"{kind}: prompt {i} ({len(prompts[i])} tokens)"
    assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leaks(llm)


# TP 2 with EP splits MLA's heads as plain TP 2 does; the experts' width split of plain TP (with
# FusedMoE's routing step) is the other MoE families' (tests/models/test_moe_families.py).
@pytest.mark.parametrize("expert_parallel", [True], ids=["tp-ep"])
def test_tensor_parallel_matches_hf(models, hf_greedy, expert_parallel):
    """TP = 2 (gloo, one worker process) on V3: each rank 2 of the 4 heads (q_b_proj, kv_b_proj and
    o_proj split by head) over the whole latent cache; the experts split by width, or with expert
    parallelism 4 whole experts per rank (the grouped routing's global ids mapped to them); greedy
    tokens are HF's."""
    from tokenmill.entrypoints.llm import LLM

    llm = LLM(str(models["v3"][2]), tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
              dtype="float32", device="cpu", num_kv_blocks=64, max_num_seqs=8)
    try:
        outs = llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS),
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy["v3"]
        layers = llm.engine.loaded.model.model.layers
        attn = layers[0].self_attn
        assert attn.num_heads == attn.attn.num_heads == 2
        assert tuple(attn.attn.kv_b_proj.weight.shape) == (2 * (16 + 16), 32)  # this rank's 2 heads
        assert tuple(attn.o_proj.weight.shape) == (64, 2 * 16)
        experts = layers[1].mlp.experts
        expected = (4, 2 * 32, 64) if expert_parallel else (8, 2 * 16, 64)
        assert tuple(experts.w13_weight.shape) == expected
    finally:
        llm.engine.close()


def test_mtp_layers_skipped_at_load(models, caplog):
    """V3's checkpoint has a layer past num_hidden_layers (multi-token prediction): skipped, logged."""
    logger = logging.getLogger("tokenmill")  # it does not propagate to the root, where caplog listens
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level("INFO", logger="tokenmill"):
            load_model(str(models["v3"][2]), dtype="float32", device="cpu")
    finally:
        logger.removeHandler(caplog.handler)
    assert "skipped the checkpoint's multi-token-prediction layers [3]" in caplog.text


def test_refused_options(models):
    from tokenmill.engine.llm_engine import check_model_options

    arch = models["v3"][1].arch
    with pytest.raises(ConfigError, match="enable_lora: LoRA adapters on DeepseekV3ForCausalLM"):
        check_model_options(EngineConfig(enable_lora=True), arch)
    with pytest.raises(ConfigError, match="kv_cache_dtype fp8: DeepseekV3ForCausalLM's latent KV cache"):
        check_model_options(EngineConfig(kv_cache_dtype="fp8"), arch)
    with pytest.raises(ConfigError, match="speculative decoding on DeepseekV3ForCausalLM"):
        check_model_options(EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), arch)
    with pytest.raises(ConfigError, match="batch_invariant: DeepseekV3ForCausalLM's latent attention"):
        check_model_options(EngineConfig(batch_invariant=True), arch)


def test_v2_lite_preset_read_as_hf_reads_it():
    """The deepseek-v2-lite preset: HF's own model of it (on the meta device) has as many parameters
    as tokenmill counts (15.7B); the roofline counts one latent row (512 + 64) per token and layer."""
    import transformers as tf

    from tokenmill.bench.roofline import attention_flops_per_pair, kv_bytes_per_token
    from tokenmill.models.config import arch_config_from_hf
    from tokenmill.models.presets import get_preset

    preset = get_preset("deepseek-v2-lite")
    arch = arch_config_from_hf(preset)
    hf_config = tf.DeepseekV2Config(**{k: v for k, v in preset.items() if k not in ("architectures", "torch_dtype")})
    with torch.device("meta"):
        hf = tf.DeepseekV2ForCausalLM(hf_config)
    assert arch.num_parameters() == sum(p.numel() for p in hf.parameters())
    assert 15.6e9 < arch.num_parameters() < 15.8e9 and 2.5e9 < arch.num_active_parameters() < 2.8e9
    assert arch.rope.kind == "yarn" and arch.rope.factor == 40
    assert arch.attn_scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    assert kv_bytes_per_token(arch, 2) == 27 * (512 + 64) * 2
    assert attention_flops_per_pair(arch) == 2 * 16 * (192 + 128)  # the expanded form is the cheaper


def test_dummy_weights_preset_generates():
    """load_format dummy (the bench's path) on the tiny-deepseek preset: every parameter filled, and
    an engine decodes from it (prefill expanded, decode absorbed)."""
    loaded = load_model("tiny-deepseek", load_format="dummy", seed=1)
    assert all(p.isfinite().all() for p in loaded.model.parameters())
    llm = make_llm(loaded, max_model_len=64)
    outs = llm.generate([[5, 6, 7], list(range(3, 40))], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    assert_no_leaks(llm)


def test_fp8_weights_refused(models):
    from tokenmill.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="FP8 weights on DeepseekV2ForCausalLM are not supported yet"):
        load_model(str(models["v2"][2]), dtype="float32", device="cpu", quantization="fp8")


def test_prefix_cache_hit_matches_hf(models, hf_greedy):
    """A prompt whose first 32 tokens are already cached (a finished request's blocks): its prefill
    attends over the cached latent rows it did not compute, and greedy tokens are still HF's."""
    llm = make_llm(models["v2"][1], max_model_len=64, enable_prefix_caching=True)
    prompt = _prompts()[3]  # 37 tokens: two full blocks of 16 are shared
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    first = llm.generate([prompt], greedy, use_tqdm=False)[0]
    again = llm.generate([prompt], greedy, use_tqdm=False)[0]
    assert llm.engine.kv.prefix_hits >= 32
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == hf_greedy["v2"][3]
    assert_no_leaks(llm)


@torch.no_grad()
def test_attend_reads_and_writes_cache_row_wide_buffers(models):
    """The piecewise graphs' contract (their q and output buffers are a cache row wide, shared by
    every layer): attend reads q's first nope + rope dims, writes the output's first v dims, and
    gives what it gives for a q of its own width, for a prefill and a decode step."""
    model = models["v3"][1].model
    attn = model.model.layers[0].self_attn.attn
    width = model.attention_spec().head_dim  # 40: R + P
    caches = scratch_kv_caches(model, 4)
    gen = torch.Generator().manual_seed(5)
    caches[0][0].copy_(torch.randn(caches[0][0].shape, generator=gen))
    tables = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
    steps = [AttentionMetadata(torch.tensor([0, 5, 8], dtype=torch.int32), torch.tensor([20, 3], dtype=torch.int32),
                               tables, torch.zeros(8, dtype=torch.int64), max_query_len=5, max_seq_len=20),
             AttentionMetadata(torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([20, 3], dtype=torch.int32),
                               tables, torch.zeros(2, dtype=torch.int64), max_query_len=1, max_seq_len=20)]
    for meta in steps:
        tokens = int(meta.query_start_loc[-1])
        wide_q = torch.randn(tokens, attn.num_heads, width, generator=gen)
        wide_out = torch.full((tokens, attn.num_heads, width), 7.0)
        attn.attend(wide_q, meta, caches, out=wide_out)
        ref = attn.attend(wide_q[..., : attn.qk_head_dim].contiguous(), meta, caches)
        torch.testing.assert_close(wide_out[..., : attn.v_head_dim], ref, rtol=1e-6, atol=1e-6)
        assert (wide_out[..., attn.v_head_dim:] == 7.0).all()


def test_v2_lite_greedy_routing_is_plain_top_k():
    """V2-Lite's routing (greedy, one group, scale 1, no renormalisation) takes FusedMoE's plain
    softmax top-k (the routing kernel of the other families); V3's takes the grouped routing."""
    from tokenmill.models.config import arch_config_from_hf
    from tokenmill.models.presets import get_preset

    assert not arch_config_from_hf(get_preset("deepseek-v2-lite")).moe.grouped_routing
    assert arch_config_from_hf(get_preset("tiny-deepseek")).moe.grouped_routing
