"""Multi-LoRA in the engine: three adapters and the base model in one batch, against HF transformers +
PEFT (fp32): every step's logits within 1e-4 relative and identical greedy tokens, in several
scheduling regimes; slots, eviction, removal, the prefix cache and bad adapters."""

import json
import os

import pytest
import torch

from tests.engine.conftest import assert_no_leaks, make_llm
from tests.lora_adapters import make_adapter, peft_reference
from tokenmill import LoRARequest
from tokenmill.errors import LoRAError
from tokenmill.sampling_params import SamplingParams

NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW)
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
             "Why is the sky blue?", "What does a CPU do?", "Give me a tip for learning to cook."]


@pytest.fixture(scope="module")
def adapters(hf_smollm, tmp_path_factory):
    """Three different adapters of the embedded model: ranks 8 / 4 / 16 (rsLoRA), different modules."""
    root = tmp_path_factory.mktemp("loras")
    specs = [dict(rank=8, alpha=16, seed=1),
             dict(rank=4, alpha=8, seed=2, target_modules=("q_proj", "v_proj", "down_proj")),
             dict(rank=16, alpha=8, seed=3, target_modules=("k_proj", "o_proj", "gate_proj", "up_proj"),
                  use_rslora=True)]
    return [LoRARequest(f"a{i}", i + 1, make_adapter(hf_smollm, root / f"a{i}", **spec))
            for i, spec in enumerate(specs)]


@pytest.fixture(scope="module")
def peft_models(hf_smollm, adapters):
    return [hf_smollm] + [peft_reference(hf_smollm, a.lora_path) for a in adapters]


@pytest.fixture(scope="module")
def prompts(smollm):
    tok = smollm.tokenizer
    return [tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                        add_generation_prompt=True), add_special_tokens=False)["input_ids"]
            for q in QUESTIONS]


def _record_logits(llm):
    """Keep each step's logits by request id (a spy on the runner's real sample_tokens)."""
    runner, seen = llm.engine.runner, {}
    real = runner.sample_tokens

    def sample_tokens(*args, **kwargs):
        for req_id, row in zip(runner._req_ids, runner._logits.float()):
            seen.setdefault(req_id, []).append(row.clone())
        return real(*args, **kwargs)

    runner.sample_tokens = sample_tokens
    return seen


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


REGIMES = {"default": {}, "sync": dict(async_scheduling=False), "chunked": dict(max_num_batched_tokens=24),
           "preemption": dict(block_size=8, num_kv_blocks=16, max_num_seqs=6)}


@pytest.mark.parametrize("regime", list(REGIMES))
def test_adapters_in_one_batch_match_peft(regime, smollm, adapters, peft_models, prompts):
    llm = make_llm(smollm, enable_lora=True, max_loras=3, max_lora_rank=16, **REGIMES[regime])
    choice = [None, adapters[0], adapters[1], adapters[2], adapters[0], None]  # per prompt
    seen = _record_logits(llm)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=choice)
    for out, ids, lora in zip(outs, prompts, choice):
        ref_model = peft_models[0 if lora is None else lora.lora_int_id]
        tokens = out.outputs[0].token_ids
        ref = _hf_logits(ref_model, ids + tokens)
        steps = seen[out.request_id]
        if regime == "default":
            assert len(steps) == NEW
        mine = torch.stack(steps[-NEW:])  # the last NEW sampling steps: positions len(ids)-1 ...
        theirs = ref[len(ids) - 1 : len(ids) - 1 + NEW]
        err = ((mine - theirs).norm(dim=-1) / theirs.norm(dim=-1)).max().item()
        assert err < 1e-4, (regime, lora, err)
        masked = theirs.clone()
        masked[:, list(smollm.eos_token_ids)] = -float("inf")  # min_tokens masks EOS
        assert tokens == masked.argmax(-1).tolist()  # greedy along its own path = HF+PEFT's greedy
        if lora is not None:  # the adapter is no no-op: the base model's logits are far from these
            base = _hf_logits(peft_models[0], ids + tokens)[len(ids) - 1 : len(ids) - 1 + NEW]
            assert ((base - theirs).norm(dim=-1) / theirs.norm(dim=-1)).min().item() > 1e-2
    if regime == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leaks(llm)


def test_adapters_on_fp8_weights_match_peft_on_the_same_weights(hf_smollm, adapters, prompts):
    """FP8 weights (quantization="fp8") with adapters: HF + PEFT over a copy of the model whose
    linear weights are replaced by the same dequantized e4m3 values is the reference."""
    import copy

    from tokenmill.loader import load_model
    from tokenmill.quantization.fp8 import dequantize_weight_fp8, quantize_weight_fp8

    hf8 = copy.deepcopy(hf_smollm)
    with torch.no_grad():
        for name, mod in hf8.named_modules():
            if isinstance(mod, torch.nn.Linear) and not name.endswith("lm_head"):
                w_q, scale = quantize_weight_fp8(mod.weight)  # per row: the same as on a fused q/k/v row
                mod.weight.copy_(dequantize_weight_fp8(w_q, scale, torch.float32))
    llm = make_llm(load_model(None, dtype="float32", device="cpu", quantization="fp8"), enable_lora=True,
                   max_loras=3, max_lora_rank=16)
    choice = [adapters[0], None]  # an adapter's rows and the base rows in one batch
    seen = _record_logits(llm)
    outs = llm.generate(prompts[:2], GREEDY, use_tqdm=False, lora_request=choice)
    for out, ids, lora in zip(outs, prompts, choice):
        ref_model = hf8 if lora is None else peft_reference(hf8, lora.lora_path)
        tokens = out.outputs[0].token_ids
        theirs = _hf_logits(ref_model, ids + tokens)[len(ids) - 1 : len(ids) - 1 + NEW]
        mine = torch.stack(seen[out.request_id][-NEW:])
        err = ((mine - theirs).norm(dim=-1) / theirs.norm(dim=-1)).max().item()
        assert err < 1e-4, (lora, err)
        plain = _hf_logits(hf_smollm if lora is None else peft_reference(hf_smollm, lora.lora_path), ids + tokens)
        plain = plain[len(ids) - 1 : len(ids) - 1 + NEW]
        assert ((plain - theirs).norm(dim=-1) / theirs.norm(dim=-1)).max().item() > 1e-3  # FP8 changed them
    assert_no_leaks(llm)


def test_greedy_tokens_equal_peft_generate(smollm, adapters, peft_models, prompts):
    llm = make_llm(smollm, enable_lora=True, max_loras=2, max_lora_rank=16)
    choice = [adapters[2], adapters[1], None, adapters[2]]
    outs = llm.generate(prompts[:4], GREEDY, use_tqdm=False, lora_request=choice)
    for out, ids, lora in zip(outs, prompts, choice):
        model = peft_models[0 if lora is None else lora.lora_int_id]
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                 pad_token_id=2)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref
    assert_no_leaks(llm)


def test_slots_evict_least_recently_used(smollm, adapters, prompts):
    """One slot, three adapters: each batch admits one adapter at a time, the others wait; slots
    are rewritten as adapters change; outputs equal each adapter's run alone."""
    alone = {}
    for lora in adapters:
        llm1 = make_llm(smollm, enable_lora=True, max_loras=3, max_lora_rank=16)
        alone[lora.lora_int_id] = llm1.generate(prompts[:1], GREEDY, use_tqdm=False,
                                                lora_request=lora)[0].outputs[0].token_ids
    llm = make_llm(smollm, enable_lora=True, max_loras=1, max_lora_rank=16)
    choice = [adapters[0], adapters[1], adapters[2], adapters[0]]
    outs = llm.generate([prompts[0]] * 4, GREEDY, use_tqdm=False, lora_request=choice)
    for out, lora in zip(outs, choice):
        assert out.outputs[0].token_ids == alone[lora.lora_int_id]
    slots = llm.engine.runner.lora.slots
    assert slots.loads >= 3  # the one slot was written for each adapter in turn
    assert len(slots.resident()) == 1
    assert_no_leaks(llm)


def test_prefix_cache_is_keyed_by_adapter(smollm, adapters, prompts):
    llm = make_llm(smollm, enable_lora=True, max_loras=2, max_lora_rank=16)
    p = prompts[0]
    first = llm.generate([p], GREEDY, use_tqdm=False, lora_request=adapters[0])[0]
    other = llm.generate([p], GREEDY, use_tqdm=False, lora_request=adapters[1])[0]
    again = llm.generate([p], GREEDY, use_tqdm=False, lora_request=adapters[0])[0]
    base = llm.generate([p], GREEDY, use_tqdm=False)[0]
    assert other.metrics.num_cached_prompt_tokens == 0  # another adapter: no hit on a0's blocks
    assert again.metrics.num_cached_prompt_tokens >= 16  # the same adapter: a hit
    assert base.metrics.num_cached_prompt_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_no_leaks(llm)


def test_add_remove_list(smollm, adapters, prompts):
    llm = make_llm(smollm, enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2)
    engine = llm.engine
    for a in adapters:
        engine.add_lora(a)
    assert engine.list_loras() == [1, 2, 3]
    assert engine.loras.num_in_memory() == 2  # max_cpu_loras: the least recently used left host memory
    # an adapter that left host memory is read again when a request needs it
    out = llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=adapters[0])[0]
    assert len(out.outputs[0].token_ids) == NEW
    assert engine.remove_lora(1) and not engine.remove_lora(1)
    assert engine.list_loras() == [2, 3]
    # a request queued before the removal still finishes with its adapter
    engine.add_request(prompts[1], GREEDY, "q", prompt_ids=prompts[1], lora_request=adapters[1])
    engine.remove_lora(2)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["q"] and len(done[0].outputs[0].token_ids) == NEW
    with pytest.raises(LoRAError, match="already names"):
        engine.add_lora(LoRARequest("other", 3, adapters[0].lora_path))
    assert_no_leaks(llm)


def _bad(tmp_path, good: str, edit) -> str:
    import shutil

    path = tmp_path / "bad"
    shutil.copytree(good, path)
    edit(path)
    return str(path)


def _set_config(**kv):
    def edit(path):
        cfg = json.loads((path / "adapter_config.json").read_text())
        cfg.update(kv)
        (path / "adapter_config.json").write_text(json.dumps(cfg))
    return edit


@pytest.mark.parametrize("case,edit,message", [
    ("dora", _set_config(use_dora=True), "use_dora"),
    ("bias", _set_config(bias="all"), "bias"),
    ("modules_to_save", _set_config(modules_to_save=["lm_head"]), "modules_to_save"),
    ("unknown module", _set_config(target_modules=["q_proj", "lm_head"]), "lm_head"),
    ("not lora", _set_config(peft_type="IA3"), "IA3"),
    ("no config", lambda p: os.remove(p / "adapter_config.json"), "adapter_config.json is missing"),
    ("no weights", lambda p: os.remove(p / "adapter_model.safetensors"), "adapter_model.safetensors is missing"),
    ("pickled", lambda p: os.rename(p / "adapter_model.safetensors", p / "adapter_model.bin"), "pickled"),
    ("garbage", lambda p: (p / "adapter_model.safetensors").write_bytes(b"not a safetensors file"), "could not be read"),
])
def test_bad_adapters_are_refused_clearly(case, edit, message, smollm, adapters, prompts, tmp_path):
    llm = make_llm(smollm, enable_lora=True, max_loras=2, max_lora_rank=16)
    bad = LoRARequest("bad", 9, _bad(tmp_path, adapters[0].lora_path, edit))
    with pytest.raises(LoRAError, match=message):
        llm.generate(prompts[:2], GREEDY, use_tqdm=False, lora_request=[None, bad])
    assert not llm.engine.has_unfinished_requests()  # nothing of the refused batch was queued
    out = llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=adapters[0])[0]  # still serving
    assert len(out.outputs[0].token_ids) == NEW
    assert_no_leaks(llm)


def test_rank_above_max_and_lora_disabled(smollm, adapters, prompts, hf_smollm, tmp_path):
    llm = make_llm(smollm, enable_lora=True, max_loras=1, max_lora_rank=8)
    with pytest.raises(LoRAError, match="above max_lora_rank 8"):
        llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=adapters[2])  # rank 16
    plain = make_llm(smollm)
    with pytest.raises(LoRAError, match="not enabled"):
        plain.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=adapters[0])
    # an adapter of another model (other shapes) is refused, naming the shapes
    import transformers as tf

    tiny = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))
    other = LoRARequest("other", 5, make_adapter(tiny, tmp_path / "tiny", rank=4))
    with pytest.raises(LoRAError, match="another base model"):
        llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=other)
    assert_no_leaks(llm)


def test_through_the_engine_process(smollm, adapters, prompts, tmp_path):
    """The engine in its own process: adapters added by call (a bad one: the same LoRAError), requests
    with adapters equal the in-process engine's tokens, list and remove cross the boundary."""
    import time

    from tokenmill.config import EngineConfig
    from tokenmill.serve.core_client import EngineCoreClient
    from tokenmill.serve.core_process import EngineLaunch

    config = dict(num_kv_blocks=256, max_num_seqs=16, max_num_batched_tokens=2048, enable_lora=True, max_loras=2,
                  max_lora_rank=16)
    client = EngineCoreClient.launch(EngineLaunch(None, EngineConfig(**config), dtype="float32", device="cpu"))
    try:
        for a in adapters[:2]:
            client.add_lora(a)
        assert client.list_loras() == [1, 2]
        with pytest.raises(LoRAError, match="adapter_config.json is missing"):
            client.add_lora(LoRARequest("missing", 7, str(tmp_path)))
        choice = [adapters[0], None, adapters[1]]
        for i, (ids, lora) in enumerate(zip(prompts, choice)):
            client.add_request(None, GREEDY, f"r{i}", ids, lora_request=lora)
        final, deadline = {}, time.monotonic() + 300
        while client.has_unfinished_requests():
            assert time.monotonic() < deadline
            final.update({o.request_id: o for o in client.step() if o.finished})
        local = make_llm(smollm, **config).generate(prompts[:3], GREEDY, use_tqdm=False, lora_request=choice)
        assert [final[f"r{i}"].outputs[0].token_ids for i in range(3)] == [o.outputs[0].token_ids for o in local]
        assert client.remove_lora(1) and not client.remove_lora(1)
        assert client.list_loras() == [2]
    finally:
        client.close()
