"""Speculative decoding with a draft model and with the layer-truncated self-draft (embedded model,
fp32, CPU): greedy output equals greedy output without speculation, token for token, in every
scheduling regime; the embedded model drafting for itself has every draft accepted; limits, stops
and n > 1 hold; the scheduler holds the draft's lookahead slots (n-gram none); nothing leaks."""

import dataclasses

import pytest
import torch

from tests.engine.conftest import assert_no_leaks, make_llm
from tests.engine.test_spec_decode import _copy_prompt
from tokenmill.config import ConfigError, EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.llm import LLM
from tokenmill.loader.resolve import embedded_model_path
from tokenmill.sampling_params import SamplingParams

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
DRAFT_LAYERS = 24  # of the embedded model's 30: about a quarter of the drafts accepted (measured)
PROPOSERS = {
    # The embedded GGUF as its own draft: every greedy draft is the target's own argmax.
    "draft_model": {"method": "draft_model", "model": "smollm2-135m-instruct", "num_speculative_tokens": 4},
    "layer_truncated": {"method": "layer_truncated", "num_draft_layers": DRAFT_LAYERS, "num_speculative_tokens": 2},
}
# With the defaults (async scheduling, the prefix cache, batches of 8) they cover synchronous
# scheduling with chunked prefill, and preemption with a second round served from the prefix cache.
REGIMES = {
    "sync-chunked-no-prefix-cache": dict(async_scheduling=False, max_num_batched_tokens=24,
                                         enable_prefix_caching=False),
    "preemption-prefix-cache-async": dict(num_kv_blocks=10, max_num_seqs=4, max_num_batched_tokens=48),
}


class FirstLayers(torch.nn.Module):
    """A draft model (the CausalLM interface) made of the target's first n layers, final norm and
    LM head: it drafts exactly what the layer-truncated draft of n layers drafts, through a cache of
    its own and the replay of every step."""

    def __init__(self, target: torch.nn.Module, n: int):
        super().__init__()
        self.target, self.n = target, n
        self.config = dataclasses.replace(target.config, num_layers=n)

    def forward(self, input_ids, positions):
        return self.target.forward_first_layers(input_ids, positions, self.n)

    def compute_logits(self, hidden):
        return self.target.compute_logits(hidden)

    def attention_spec(self):
        return dataclasses.replace(self.target.attention_spec(), num_layers=self.n)


@pytest.fixture(scope="module")
def plain_greedy(smollm, chat_prompt_ids):
    """Greedy tokens without speculation (equal to HF's: tests/engine/test_greedy_vs_hf.py)."""
    outs = make_llm(smollm).generate(chat_prompt_ids, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def spec_llm(smollm, method: str, draft=None, **overrides) -> LLM:
    """An engine over the shared target load; the draft model is the same load unless given (the
    engine would load the same file again: test_draft_is_loaded_like_the_target does that once)."""
    defaults = dict(num_kv_blocks=256, max_num_seqs=16, max_num_batched_tokens=2048)
    config = EngineConfig(**{**defaults, "speculative_config": PROPOSERS[method], **overrides})
    if method == "draft_model" and draft is None:
        draft = smollm
    return LLM.from_engine(LLMEngine(config=config, loaded=smollm, draft_loaded=draft))


def check_greedy(llm, prompt_ids, plain_greedy, rounds: int = 1) -> None:
    for _ in range(rounds):
        outs = llm.generate(prompt_ids, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == plain_greedy
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert_no_leaks(llm)


def test_self_draft_accepts_every_draft(smollm, chat_prompt_ids, plain_greedy):
    """The target as its own draft model (defaults: async scheduling, the prefix cache, a batch of
    8): plain greedy tokens, and the draft's own cache holds what the target's holds, so every
    greedy draft is accepted."""
    llm = spec_llm(smollm, "draft_model")
    check_greedy(llm, chat_prompt_ids, plain_greedy)
    stats = llm.engine.spec_stats
    assert stats.drafts > 0 and stats.acceptance_rate == 1.0, stats.summary()
    assert llm.engine.steps_completed <= 2 + -(-NEW_TOKENS // 5)  # 5 tokens a verifying step


def test_layer_truncated_and_its_draft_model_twin(smollm, chat_prompt_ids, plain_greedy):
    """The layer-truncated draft (sharing the target's cache) and a draft model of the same layers
    (a cache of its own, filled by replaying every step, rejected drafts' K/V included) give plain
    greedy tokens and make the same drafts: the same counts, position by position."""
    truncated = spec_llm(smollm, "layer_truncated")
    check_greedy(truncated, chat_prompt_ids, plain_greedy)
    twin_draft = dataclasses.replace(smollm, model=FirstLayers(smollm.model, DRAFT_LAYERS))
    twin = spec_llm(smollm, "draft_model", twin_draft,
                    speculative_config={**PROPOSERS["draft_model"], "num_speculative_tokens": 2})
    check_greedy(twin, chat_prompt_ids, plain_greedy)
    a, b = truncated.engine.spec_stats, twin.engine.spec_stats
    assert 0 < a.accepted < a.drafts, a.summary()
    assert (a.drafts, a.accepted, a.accepted_at, a.drafted_at) == (b.drafts, b.accepted, b.accepted_at, b.drafted_at)
    # The twin's cache has 24 layers beside the target's 30; the truncated draft has none of its own.
    per_layer = truncated.engine.runner.kv_bytes_per_block() // 30
    assert twin.engine.runner.kv_bytes_per_block() == (30 + DRAFT_LAYERS) * per_layer


@pytest.mark.slow
@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("method", list(PROPOSERS))
def test_greedy_equals_plain_greedy_in_every_regime(method, regime, smollm, chat_prompt_ids, plain_greedy):
    # Half the prompts: 4 of ~37 + 16 tokens (+ lookahead) still overflow 10 blocks (preemptions)
    # and still exceed a 24-token step (chunks).
    chat_prompt_ids, plain_greedy = chat_prompt_ids[:4], plain_greedy[:4]
    llm = spec_llm(smollm, method, **REGIMES[regime])
    check_greedy(llm, chat_prompt_ids, plain_greedy, rounds=2 if "prefix-cache" in regime else 1)
    engine = llm.engine
    stats = engine.spec_stats
    if method == "draft_model":  # the target drafting for itself: every draft is its own argmax
        assert stats.drafts > 0 and stats.acceptance_rate == 1.0, stats.summary()
    else:
        assert stats.accepted > 0, stats.summary()
    if "preemption" in regime:
        assert engine.scheduler.num_preemptions > 0 and engine.kv.prefix_hits > 0
    if "chunked" in regime:
        assert max(len(p) for p in chat_prompt_ids) > 24  # prompts really were split


@pytest.mark.parametrize("method", list(PROPOSERS))
def test_stops_limits_and_n(method, smollm):
    """Stop strings cut inside a step's accepted drafts, max_tokens is never exceeded, requests that
    decode plainly (logprobs) share the batch, greedy n=2 gives plain greedy twice, seeded n=2 is
    reproducible."""
    plain, spec = make_llm(smollm), spec_llm(smollm, method)
    prompt = _copy_prompt(plain)
    cases = [SamplingParams(temperature=0, max_tokens=30, stop=["mat. The"]),
             SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=10, logprobs=2),
             SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2),
             SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, n=2)]
    ref = plain.generate([prompt] * len(cases), cases, use_tqdm=False)
    out = spec.generate([prompt] * len(cases), cases, use_tqdm=False)
    for i, (a, b) in enumerate(zip(ref[:4], out[:4])):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs], i
        assert [(c.text, c.finish_reason) for c in a.outputs] == [(c.text, c.finish_reason) for c in b.outputs], i
    assert out[0].outputs[0].finish_reason == "stop" and "mat. The" not in out[0].outputs[0].text
    assert len(out[1].outputs[0].token_ids) == 7
    assert [len(c.token_ids) for c in out[3].outputs] == [12, 12]
    again = spec.generate([prompt], cases[4], use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out[4].outputs]
    assert all(len(c.token_ids) == 12 for c in out[4].outputs)
    assert spec.engine.spec_stats.accepted > 0
    assert_no_leaks(spec)


def test_draft_is_loaded_like_the_target(smollm, chat_prompt_ids, plain_greedy):
    """The engine loads the draft from its path with the target's loader, dtype and device: the
    embedded GGUF file as its own draft accepts every greedy draft."""
    config = EngineConfig(num_kv_blocks=128, max_num_seqs=4, speculative_config={
        "method": "draft_model", "model": embedded_model_path(), "num_speculative_tokens": 4})
    llm = LLM.from_engine(LLMEngine(config=config, loaded=smollm))
    engine = llm.engine
    assert engine.draft.model is not smollm.model
    assert (engine.draft.dtype, engine.draft.device) == (smollm.dtype, smollm.device)
    outs = llm.generate(chat_prompt_ids[:2], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain_greedy[:2]
    assert engine.spec_stats.drafts > 0 and engine.spec_stats.acceptance_rate == 1.0
    assert_no_leaks(llm)


def test_lookahead_slots_are_held_for_drafts_that_write_kv(smollm):
    """A speculating request of a draft that writes K/V holds k slots past its scheduled tokens
    (capped at prompt + max_tokens); with n-gram drafts it holds none."""
    prompt = list(range(100, 131))  # 31 tokens: the prefill's slots end one short of a block
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    held = {}
    for name, spec in [("ngram", {"method": "ngram", "num_speculative_tokens": 4}),
                       ("draft_model", PROPOSERS["draft_model"])]:
        config = EngineConfig(num_kv_blocks=64, max_num_seqs=2, speculative_config=spec, async_scheduling=False)
        engine = LLMEngine(config=config, loaded=smollm, draft_loaded=smollm if name == "draft_model" else None)
        request_id = engine.add_request(prompt, params)
        engine.step()  # the prefill, which samples the first token
        request = engine.scheduler.running[0]
        held[name] = (len(request.block_ids), request.num_computed_tokens)
        engine.abort_request(request_id)
        engine.step()
        assert not engine.has_unfinished_requests() and engine.kv.num_free_blocks == engine.kv.num_blocks
    assert held["ngram"] == (2, 31)  # 31 slots: two blocks
    assert held["draft_model"] == (3, 31)  # 31 + 4 lookahead slots: three blocks
    assert engine.scheduler.limits.num_lookahead_tokens == 4


def test_kv_cache_counts_the_draft(smollm):
    """On a memory budget, a draft model's cache shares every block: the same bytes buy fewer
    blocks (half of them when the draft is the target itself); the layer-truncated draft costs none."""
    blocks = {}
    for name, spec in [("plain", None), ("draft_model", PROPOSERS["draft_model"]),
                       ("layer_truncated", PROPOSERS["layer_truncated"])]:
        config = EngineConfig(kv_cache_memory_gb=0.01, max_num_seqs=2, speculative_config=spec)
        engine = LLMEngine(config=config, loaded=smollm, draft_loaded=smollm if name == "draft_model" else None)
        blocks[name] = engine.kv.num_blocks
        if name == "draft_model":
            draft_cache = engine.runner.spec.proposer.kv_caches
            assert len(draft_cache) == 30 and draft_cache[0][0].shape[0] == blocks[name]
            assert draft_cache[0][0].data_ptr() != engine.runner.kv_caches[0][0].data_ptr()
    assert blocks["draft_model"] == blocks["plain"] // 2
    assert blocks["layer_truncated"] == blocks["plain"]


def test_bad_draft_configs_are_refused(smollm):
    with pytest.raises(ConfigError, match="vocabulary of 1024 tokens but the target's has 49152"):
        LLMEngine(config=EngineConfig(num_kv_blocks=16, speculative_config={
            "method": "draft_model", "model": "tiny-llama", "load_format": "dummy"}), loaded=smollm)
    with pytest.raises(ConfigError, match=r"num_draft_layers must be in 1\.\.29 \(the target has 30"):
        LLMEngine(config=EngineConfig(num_kv_blocks=16, speculative_config={
            "method": "layer_truncated", "num_draft_layers": 30}), loaded=smollm)
    with pytest.raises(ConfigError, match='needs "model"'):
        EngineConfig(speculative_config={"method": "draft_model"})
