"""Speculative decoding with n-gram drafts: greedy output equals greedy output without speculation
(and HF's) in every scheduling regime; drafts are accepted; limits and stops hold."""

import pytest

from tests.engine.conftest import assert_no_leaks, make_llm
from tests.engine.test_greedy_vs_hf import CONFIGS, check_batch_matches_hf
from tokenmill.sampling_params import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
COPY = "Copy this text exactly: The cat sat on the mat. The cat sat on the mat. The cat sat on the mat."


def _copy_prompt(llm) -> list[int]:
    tok = llm.engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": COPY}], tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


# Chunked prefill and preemption: test_everything_on_together below (both at once, asserted).
@pytest.mark.parametrize("name", [name for name in CONFIGS if name not in ("chunked-prefill", "preemption")])
def test_greedy_with_ngram_matches_hf(name, smollm, chat_prompt_ids, hf_greedy):
    llm = make_llm(smollm, speculative_config=NGRAM, **CONFIGS[name])
    check_batch_matches_hf(llm, name, chat_prompt_ids, hf_greedy)
    assert_no_leaks(llm)


def test_drafts_are_accepted_and_output_is_unchanged(smollm):
    plain, spec = make_llm(smollm), make_llm(smollm, speculative_config=NGRAM)
    prompt = _copy_prompt(plain)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    out = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert out == ref and len(out) == 40  # max_tokens exactly, never more
    assert spec.engine.steps_completed <= 30  # several tokens per step: drafts were accepted (24 seen)
    stats = spec.engine.spec_stats
    assert 0 < stats.accepted <= stats.drafts and stats.mean_accepted_length > 1.5
    assert stats.accepted_at[0] >= stats.accepted_at[1] >= stats.accepted_at[2]
    assert sum(stats.accepted_at) == stats.accepted and "drafts accepted" in stats.summary()
    assert_no_leaks(spec)


def test_stops_limits_and_mixed_requests(smollm):
    """Stop strings and stop ids cut inside a step's accepted drafts; requests with penalties or
    logprobs (which decode plainly) share the batch and give what they give without speculation."""
    plain, spec = make_llm(smollm), make_llm(smollm, speculative_config=NGRAM)
    prompt = _copy_prompt(plain)
    cases = [SamplingParams(temperature=0, max_tokens=30, stop=["mat. The"]),
             SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3),
             SamplingParams(temperature=0, max_tokens=20, logprobs=2),
             SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True, n=2)]
    ref = plain.generate([prompt] * len(cases), cases, use_tqdm=False)
    out = spec.generate([prompt] * len(cases), cases, use_tqdm=False)
    for i, (a, b) in enumerate(zip(ref, out)):
        if i == 4:  # sampled: reproducible, the same distribution, not the same draws
            again = spec.generate([prompt], cases[4], use_tqdm=False)[0]
            assert [c.token_ids for c in again.outputs] == [c.token_ids for c in b.outputs]
            assert all(len(c.token_ids) == 20 for c in b.outputs)
            continue
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs], i
        assert [c.text for c in a.outputs] == [c.text for c in b.outputs]
        assert [c.finish_reason for c in a.outputs] == [c.finish_reason for c in b.outputs]
    assert out[0].outputs[0].finish_reason == "stop" and "mat. The" not in out[0].outputs[0].text
    assert len(out[1].outputs[0].token_ids) == 7
    for x, y in zip(ref[3].outputs[0].logprobs, out[3].outputs[0].logprobs):
        assert x.keys() == y.keys()
    assert_no_leaks(spec)


def test_bad_speculative_config_is_refused():
    from tokenmill.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        EngineConfig(speculative_config={"prompt_lookup_min": 5, "prompt_lookup_max": 2})
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        EngineConfig(speculative_config={"num_speculative_tokens": 0})
    with pytest.raises(ConfigError, match="speculative_config"):
        EngineConfig(speculative_config={"proposer": "x"})


@pytest.mark.parametrize("rate", [0.0, 0.7, 1.0])
def test_synthetic_acceptance_for_benchmarks(rate):
    """Random weights accept nothing; with synthetic_acceptance every step drafts k tokens and each
    is accepted with that probability, so tokens per verifying step follow the rate."""
    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.entrypoints.llm import LLM

    config = EngineConfig(num_kv_blocks=64, max_num_seqs=4,
                          speculative_config={**NGRAM, "synthetic_acceptance": rate})
    llm = LLM.from_engine(LLMEngine("tiny-llama", config, load_format="dummy", dtype="float32", device="cpu"))
    outs = llm.generate([[1, 2, 3, 4, 5]] * 4, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                        use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 60 for o in outs)
    stats = llm.engine.spec_stats
    expected = sum(rate ** i for i in range(4))  # 1 + a + a^2 + a^3 tokens a verifying step
    assert abs(stats.mean_accepted_length - expected) < 0.35, (stats.mean_accepted_length, expected)
    with pytest.raises(Exception, match="synthetic_acceptance"):
        EngineConfig(speculative_config={"synthetic_acceptance": 1.5})


def test_served_stream_with_speculation(smollm):
    """Through the async front end (the server's engine loop, detokenizing thread and streams): a
    speculating request streams several tokens per output and ends as LLM.generate without
    speculation ends, stop string included."""
    import asyncio

    from tokenmill.serve.async_engine import AsyncLLMEngine

    plain = make_llm(smollm)
    prompt = _copy_prompt(plain)
    params = SamplingParams(temperature=0, max_tokens=40, stop=["mat. The cat sat on the mat. The"])
    ref = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert ref.finish_reason == "stop"
    engine = make_llm(smollm, speculative_config=NGRAM).engine
    aengine = AsyncLLMEngine(engine)

    async def main():
        aengine.start()
        try:
            return [out async for _, out in aengine.submit(lambda tools: [(None, list(prompt))], params)]
        finally:
            await asyncio.sleep(0.3)  # a stop string's abort reaches the engine
            await aengine.stop()

    outs = asyncio.run(main())
    final = outs[-1].outputs[0]
    assert (final.token_ids, final.text, final.finish_reason, final.stop_reason) == \
        (ref.token_ids, ref.text, ref.finish_reason, ref.stop_reason)
    grew = [len(b.outputs[0].token_ids) - len(a.outputs[0].token_ids) for a, b in zip(outs, outs[1:])]
    assert max(grew) > 1  # several tokens arrived in one streamed output
    assert not engine.has_unfinished_requests() and engine.kv.num_free_blocks == engine.kv.num_blocks


def test_everything_on_together(smollm, chat_prompt_ids, hf_greedy):
    """Speculation with chunked prefill, preemption, the prefix cache (a second round served from
    it) and async scheduling all at once: still HF's greedy tokens, and nothing leaks."""
    llm = make_llm(smollm, speculative_config=NGRAM, max_num_batched_tokens=24, num_kv_blocks=14,
                   max_num_seqs=4, enable_prefix_caching=True, async_scheduling=True)
    for _ in range(2):
        check_batch_matches_hf(llm, "preemption", chat_prompt_ids, hf_greedy)
    assert llm.engine.kv.prefix_hits > 0
    assert llm.engine.spec_stats.drafts > 0
    assert_no_leaks(llm)
