"""Mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE) from tiny random models saved
by HF transformers: tokenmill's logits are HF's; greedy tokens through the engine are HF's generate
for prompts of mixed lengths submitted together, with chunked prefill, preemption, n-gram
speculation, a grammar on one request and prompt logprobs (HF's log-softmax) on another, under sync
and async scheduling; the same under tensor, expert and data parallelism; the fused 3D expert
layout loads as the per-expert one does; batch-invariant mode gives each request the same bits alone
and in a busy batch; LoRA adapters (not of the experts) give PEFT's tokens; what MoE does not support
yet is refused by name."""

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
    prompt_lp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)  # chunked over 3 steps
    outs = llm.generate(prompts + [prompts[3], prompts[3]], [greedy] * len(prompts) + [grammar, prompt_lp],
                        use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out.outputs[0].token_ids == ref, f"{family}: prompt {i} ({len(prompts[i])} tokens)"
    assert outs[-2].outputs[0].token_ids == grammar_ref
    assert len(outs[-2].outputs[0].text) == NEW_TOKENS and set(outs[-2].outputs[0].text) <= set(LETTERS)
    ids = prompts[3]
    with torch.no_grad():
        ref_lp = torch.log_softmax(models[family][0](torch.tensor([ids])).logits[0].float(), dim=-1)
    lp = outs[-1].prompt_logprobs
    assert lp[0] is None and len(lp) == len(ids)
    for i in range(1, len(ids)):
        assert abs(lp[i][ids[i]].logprob - ref_lp[i - 1, ids[i]].item()) < 1e-4, (family, i)
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


def test_expert_parallel_tp2_matches_hf(models, hf_greedy):
    """enable_expert_parallel over TP = 2 (gloo) with micro-batching: each rank holds 4 of Qwen3-MoE's
    8 whole experts, runs them on both halves of the tokens and sums over the ranks (the first
    half's all-reduce under the second half's experts); greedy tokens are still HF's."""
    from tokenmill.entrypoints.llm import LLM

    _, _, path = models["qwen3_moe"]
    refs, _ = hf_greedy["qwen3_moe"]
    llm = LLM(str(path), tensor_parallel_size=2, enable_expert_parallel=True, enable_microbatching=True,
              dtype="float32", device="cpu", num_kv_blocks=64, max_num_seqs=8)
    try:
        outs = llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS),
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == refs
        experts = llm.engine.loaded.model.model.layers[0].mlp.experts
        assert tuple(experts.w13_weight.shape) == (4, 64, 64) and experts.local_expert_ids == [0, 1, 2, 3]
        assert experts.expert_map.tolist() == [0, 1, 2, 3, -1, -1, -1, -1]
    finally:
        llm.engine.close()


# Data parallelism with expert parallelism: rank 0 runs four prompts, rank 1 one prompt of 3 tokens,
# after which it has no requests and runs dummy steps while rank 0 goes on.
DP_WORK = {0: [(0, NEW_TOKENS), (1, NEW_TOKENS), (2, NEW_TOKENS), (3, NEW_TOKENS)], 1: [(4, 3)]}


def _dp_rank_main(rank: int, path: str, port: int, microbatching: bool, out_dir: str) -> None:
    import json

    from tokenmill.config import DataParallelRank

    torch.set_num_threads(1)
    config = EngineConfig(data_parallel_size=2, enable_expert_parallel=True, enable_microbatching=microbatching,
                          max_num_seqs=8, **BUSY)
    engine = LLMEngine(path, config, dtype="float32", device="cpu",
                       data_parallel=DataParallelRank(rank, 2, f"tcp://127.0.0.1:{port}"))
    prompts = _prompts()
    for index, tokens in DP_WORK[rank]:
        engine.add_request(prompts[index], SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens),
                           request_id=str(index))
    done, steps = {}, 0
    while True:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if not engine.dp_busy:  # the same agreement on both ranks: they leave the loop together
            break
    experts = engine.loaded.model.model.layers[0].mlp.experts
    record = dict(tokens=done, steps=steps, dummy_steps=engine.lockstep.dummy_steps,
                  agreements=engine.lockstep.steps, local_experts=experts.local_expert_ids,
                  preemptions=engine.scheduler.num_preemptions)
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(record, f)
    torch.distributed.destroy_process_group()


def test_data_parallel_expert_parallel_matches_hf(models, hf_greedy, tmp_path):
    """DP = 2 with EP and micro-batching (two engines in two processes, gloo): each replica has its
    own scheduler and KV cache, the experts are split over both, every step is agreed (dp_lockstep),
    a replica without requests runs dummy steps of the agreed size and each MoE layer gathers and
    combines its tokens in two halves; greedy tokens on both are HF's."""
    import json

    import torch.multiprocessing as mp

    from tests.engine.test_dp_lockstep import free_port

    _, _, path = models["qwen3_moe"]
    refs, _ = hf_greedy["qwen3_moe"]
    mp.start_processes(_dp_rank_main, args=(str(path), free_port(), True, str(tmp_path)), nprocs=2,
                       start_method="spawn")
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, record in enumerate(records):
        for index, tokens in DP_WORK[rank]:
            assert record["tokens"][str(index)] == refs[index][:tokens], f"rank {rank} prompt {index}"
    assert records[0]["local_experts"] == [0, 1, 2, 3] and records[1]["local_experts"] == [4, 5, 6, 7]
    assert records[0]["agreements"] == records[1]["agreements"] == records[0]["steps"]
    assert records[1]["dummy_steps"] > 0 and records[0]["dummy_steps"] == 0
    assert records[0]["preemptions"] > 0


def test_served_data_parallel_expert_parallel(models, hf_greedy):
    """`tokenmill serve --data-parallel-size 2 --enable-expert-parallel`: two replica processes that
    step together; one request at a time leaves the other replica idle (dummy steps), the tokens are
    HF's, and SIGTERM stops both replicas together."""
    import openai

    from tests.server.conftest import ServerProcess

    _, _, path = models["mixtral"]
    refs, _ = hf_greedy["mixtral"]
    server = ServerProcess([str(path), "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64",
                            "--data-parallel-size", "2", "--enable-expert-parallel"])
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
        for i in (0, 3):
            r = client.completions.create(model=str(path), prompt=_prompts()[i], max_tokens=8, temperature=0,
                                          extra_body={"min_tokens": 8})
            assert r.usage.completion_tokens == 8
            # (the byte tokenizer's text holds back a trailing incomplete UTF-8 sequence)
            assert r.choices[0].text.rstrip("\ufffd") == _decode(path, refs[i][:8]).rstrip("\ufffd")
        assert server.stop() == 0
        assert "joined (experts over 2 ranks)" in server.log()
    finally:
        server.stop()


def _decode(path, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path)).decode(ids)


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


def test_batch_invariant_at_tp3(tmp_path):
    """Batch-invariant mode under tensor parallelism: at TP = 3 (gloo, whose all-reduce order follows
    the message size) a Qwen3-MoE's requests give the same bits alone and together, as the ranks'
    partial sums (attention, the dense MLP, the split experts) are added in rank order; greedy is HF's.
    With the all-reduce in their place every request differed (8 of 8, 16 tokens each, 2026-12-06)."""
    import transformers as tf

    from tests.models.moe_helpers import COMMON, save_random_model
    from tokenmill.entrypoints.llm import LLM

    config = tf.Qwen3MoeConfig(**{**COMMON, "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3},
                               num_hidden_layers=3, head_dim=16, intermediate_size=96, moe_intermediate_size=48,
                               num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1])
    hf = save_random_model(config, tmp_path)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, EOS, (n,), generator=gen).tolist() for n in (5, 29, 70, 13)]
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, logprobs=2)
    llm = LLM(str(tmp_path), tensor_parallel_size=3, dtype="float32", device="cpu", max_num_seqs=16,
              num_kv_blocks=256, batch_invariant=True)
    try:
        alone = [_bits(llm.generate([p], params, use_tqdm=False)[0]) for p in prompts]
        assert [_bits(out) for out in llm.generate(prompts, params, use_tqdm=False)] == alone
    finally:
        llm.engine.close()
    for ids, bits in zip(prompts, alone):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                              pad_token_id=EOS)
        assert bits[0][0] == ref[0, len(ids):].tolist()


def test_lora_matches_peft_and_experts_are_refused(models, hf_greedy, tmp_path):
    """LoRA on MoE models, adapters made by PEFT on the HF model: Qwen2-MoE's over all seven module
    names (attention, the dense layers' MLPs, the shared experts'), Mixtral's (PEFT finds attention
    only) and Qwen3-MoE's attention give PEFT's greedy tokens in the busy regime (16-token chunked
    steps, preemption, n-gram speculation), with a base request in the batch; an adapter of Qwen3-MoE's experts (PEFT adapts its fused experts) is refused
    by name."""
    from tests.lora_adapters import ALL_MODULES, make_adapter, peft_reference
    from tokenmill.errors import LoRAError
    from tokenmill.lora.request import LoRARequest

    prompts = _prompts()[:3]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    for family, targets in (("qwen2_moe", ALL_MODULES), ("mixtral", ALL_MODULES), ("qwen3_moe", ("q_proj", "o_proj"))):
        hf, loaded, _ = models[family]
        lora = LoRARequest(family, 1, make_adapter(hf, tmp_path / family, rank=4, target_modules=targets))
        peft = peft_reference(hf, lora.lora_path)
        # 7 blocks: these four requests preempt (BUSY's 10 hold them)
        llm = make_llm(loaded, enable_lora=True, max_loras=1, max_lora_rank=8, **{**BUSY, "num_kv_blocks": 7})
        outs = llm.generate(prompts + prompts[:1], params, use_tqdm=False, lora_request=[lora] * 3 + [None])
        for ids, out in zip(prompts, outs):
            with torch.no_grad():
                ref = peft.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                    do_sample=False, pad_token_id=EOS)
            assert out.outputs[0].token_ids == ref[0, len(ids):].tolist(), family
        base = hf_greedy[family][0]
        assert outs[3].outputs[0].token_ids == base[0]
        assert any(out.outputs[0].token_ids != ref for out, ref in zip(outs, base)), f"{family}: no effect"
        assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.spec_stats.accepted > 0
        assert_no_leaks(llm)
        if family == "qwen3_moe":
            experts = LoRARequest("experts", 2, make_adapter(hf, tmp_path / "experts", rank=4))
            with pytest.raises(LoRAError, match="mixture-of-experts layer's experts, which take no adapter yet"):
                llm.generate(prompts[:1], params, use_tqdm=False, lora_request=experts)


def test_lora_and_batch_invariant_expert_parallelism_refused(models):
    _, loaded, path = models["mixtral"]
    with pytest.raises(ConfigError, match="enable_lora with enable_expert_parallel"):
        LLMEngine(config=EngineConfig(enable_lora=True, enable_expert_parallel=True, num_kv_blocks=16), loaded=loaded)
    with pytest.raises(ConfigError, match="batch_invariant does not support enable_expert_parallel"):
        LLMEngine(str(path), EngineConfig(batch_invariant=True, enable_expert_parallel=True, num_kv_blocks=16),
                  dtype="float32", device="cpu")


def _bits(out) -> list:
    return [(c.token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in c.logprobs]) for c in out.outputs]


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_invariant_requests_alone_equal_them_together(family, models, hf_greedy):
    """Batch-invariant mode with experts: each request's tokens and logprobs, greedy and seeded, are
    bit for bit its run alone when all run together in 16-token chunked steps with preemption; the
    greedy tokens are HF's."""
    _, loaded, _ = models[family]
    prompts = _prompts()
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=2)
    seeded = SamplingParams(temperature=0.9, seed=3, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=2)
    requests = [(p, greedy) for p in prompts] + [(prompts[1], seeded), (prompts[4], seeded)]
    plain = make_llm(loaded, batch_invariant=True)
    alone = [_bits(plain.generate([p], q, use_tqdm=False)[0]) for p, q in requests]
    busy = make_llm(loaded, batch_invariant=True, max_num_batched_tokens=16, num_kv_blocks=10)
    together = busy.generate([p for p, _ in requests], [q for _, q in requests], use_tqdm=False)
    assert [_bits(out) for out in together] == alone
    assert [bits[0][0] for bits in alone[:len(prompts)]] == hf_greedy[family][0]
    assert busy.engine.scheduler.num_preemptions > 0
    assert_no_leaks(busy)


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


def test_draft_speculation_on_a_moe_target():
    """The draft-based methods on a MoE target (the tiny-qwen3-moe preset): the layer-truncated
    self-draft (its first layer) and a draft model (the target itself, so every draft is accepted)
    leave greedy tokens as without speculation."""
    from tokenmill.entrypoints.llm import LLM

    loaded = load_model("tiny-qwen3-moe", load_format="dummy", device="cpu", seed=0)
    prompts = [[(7 * i + 3 * j) % 1000 for j in range(n)] for i, n in enumerate((5, 17, 30))]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in make_llm(loaded).generate(prompts, greedy, use_tqdm=False)]
    for spec, draft in (({"method": "layer_truncated", "num_draft_layers": 1, "num_speculative_tokens": 2}, None),
                        ({"method": "draft_model", "model": "tiny-qwen3-moe", "num_speculative_tokens": 3}, loaded)):
        config = EngineConfig(num_kv_blocks=64, max_num_seqs=8, speculative_config=spec)
        llm = LLM.from_engine(LLMEngine(config=config, loaded=loaded, draft_loaded=draft))
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == plain, spec
        assert llm.engine.spec_stats.drafts > 0
        assert_no_leaks(llm)
    assert llm.engine.spec_stats.acceptance_rate == 1.0  # the draft model was the target itself
