"""Every sampling feature of the engine in one run, with speculation, chunked prefill, preemption,
the prefix cache, async scheduling and a step-time target all on (and through the engine process:
tests/engine/test_engine_process.py): each request's output is token for token what it is
when run alone on a plain engine (greedy, fp32), grammars validate, banned words never appear,
allowed tokens hold, prompt logprobs are there, and nothing leaks."""

import json

import jsonschema
import pytest

from tests.engine.conftest import assert_no_leaks, chat_ids, make_llm
from tests.engine.test_lora import adapters  # noqa: F401 (a fixture)
from tests.engine.test_structured_output import NGRAM, SCHEMAS
from tokenmill.sampling_params import SamplingParams

GREEDY = dict(temperature=0, max_tokens=24)
NUM_KV_BLOCKS = 16  # of 16 tokens: the largest request fits, the batch does not (preemptions)


BUSY = dict(speculative_config=NGRAM, max_num_batched_tokens=48, num_kv_blocks=NUM_KV_BLOCKS)


def feature_requests(plain) -> tuple[list, list[int], int]:
    """(prompt ids, params) pairs using every sampling feature, the plain greedy reference of the
    `animals` prompt, and the token the bad-words requests ban."""
    copy = chat_ids(plain, "Repeat exactly: the cat sat on the mat. the cat sat on the mat.")
    animals = chat_ids(plain, "Name three animals that live in the ocean.")
    schema = SCHEMAS[0]
    person = chat_ids(plain, f"Answer in JSON following this schema: {json.dumps(schema)}")
    reference = plain.generate([animals], SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].token_ids
    banned = reference[3]  # a token the plain run emits
    requests = [
        (copy, SamplingParams(**GREEDY)),  # speculates (its drafts are found in the prompt)
        (person, SamplingParams(structured_outputs={"json": schema}, **{**GREEDY, "max_tokens": 60})),
        (copy, SamplingParams(structured_outputs={"regex": r"(the cat sat on the mat\. ){2}"}, **GREEDY)),
        (animals, SamplingParams(logit_bias={banned: -100.0}, bad_words=[plain.engine.tokenizer.decode([banned])],
                                 **GREEDY)),
        (animals, SamplingParams(allowed_token_ids=sorted(set(reference)), **GREEDY)),
        (animals, SamplingParams(prompt_logprobs=2, n=2, **GREEDY)),  # bypasses the prefix cache
        (copy, SamplingParams(bad_words=["sat on"], **GREEDY)),  # several tokens: decodes without drafts
    ]
    return requests, reference, banned


def test_features_together(smollm, features_alone):
    # A step-time target and the host KV tier too: they change the chunks and where blocks come from, never the tokens.
    busy = make_llm(smollm, step_time_target_ms=20.0, kv_offloading_size=0.05, **BUSY)
    requests, reference, banned, alone = features_alone
    schema = SCHEMAS[0]
    animals = requests[3][0]
    prompts, params = [p for p, _ in requests], [q for _, q in requests]
    together = busy.generate(prompts, params, use_tqdm=False)
    stats = busy.engine
    assert stats.scheduler.num_preemptions > 0 and stats.spec_stats.accepted > 0
    # The host tier under it all: preemption evicts blocks to the host (a resumed request reloaded
    # one block in-step in local runs; how many depends on the step-time target's chunks)
    host = stats.snapshot().kv_offload
    assert host.blocks_saved > 0 and host.failed_loads == 0
    for want, got in zip(alone, together):
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    jsonschema.validate(json.loads(together[1].outputs[0].text), schema)
    assert banned not in together[3].outputs[0].token_ids
    assert set(together[4].outputs[0].token_ids) <= set(reference)
    lp = together[5].prompt_logprobs
    assert lp[0] is None and len(lp) == len(animals) and all(lp[i] for i in range(1, len(animals)))
    assert "sat on" not in together[6].outputs[0].text
    assert_no_leaks(busy)
    assert not busy.engine.structured.matchers


def test_features_together_with_lora_adapters(smollm, adapters, features_alone):
    """The same busy run with LoRA adapters on most requests (more adapters than slots, so some wait
    for a slot) and a seeded sampled request: each request equals its run alone with its adapter;
    the adapters' requests really speculate, preempt and take grammars."""
    plain = make_llm(smollm, enable_lora=True, max_loras=3, max_lora_rank=16)
    busy = make_llm(smollm, step_time_target_ms=20.0, enable_lora=True, max_loras=2, max_lora_rank=16, **BUSY)
    requests, _, banned, _ = features_alone
    animals = requests[3][0]
    # speculation, a grammar, bad words + logit bias, n=2 with prompt logprobs, seeded sampling
    requests = [requests[i] for i in (0, 2, 3, 5)] + [(animals, SamplingParams(temperature=0.8, seed=3,
                                                                                max_tokens=24))]
    a0, a1, a2 = adapters
    loras = [a0, a1, a2, a0, None]
    alone = [plain.generate([p], q, use_tqdm=False, lora_request=lora)[0]
             for (p, q), lora in zip(requests, loras)]
    together = busy.generate([p for p, _ in requests], [q for _, q in requests], use_tqdm=False, lora_request=loras)
    assert busy.engine.scheduler.num_preemptions > 0 and busy.engine.spec_stats.accepted > 0
    for want, got in zip(alone, together):
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert together[1].outputs[0].text.startswith("the cat sat")  # the grammar held
    assert banned not in together[2].outputs[0].token_ids
    assert busy.engine.runner.lora.slots.loads >= 3  # two slots for three adapters: rewritten
    assert_no_leaks(busy)
    assert not busy.engine.structured.matchers


@pytest.fixture(scope="module")
def fp8_smollm():
    """The embedded model with FP8 weights, loaded once for the module (engines share a load)."""
    from tokenmill.loader import load_model

    return load_model(None, dtype="float32", device="cpu", quantization="fp8")


# The FP8 KV cache under the busy run is test_features_together_batch_invariant's (bit for bit there).
@pytest.mark.parametrize("kv_cache_dtype", ["auto"])
def test_features_together_with_fp8_weights(kv_cache_dtype, fp8_smollm):
    """The busy run (speculation, grammars, bad words, n = 2 with prompt logprobs, preemption, a
    step-time target) on the embedded model with FP8 weights, and with the FP8 KV cache: each
    request equals its run alone on a plain engine over the same FP8 weights and cache type, and
    nothing leaks."""
    fp8 = fp8_smollm
    plain = make_llm(fp8, kv_cache_dtype=kv_cache_dtype)
    busy = make_llm(fp8, step_time_target_ms=20.0, kv_cache_dtype=kv_cache_dtype, **BUSY)
    requests, _, banned = feature_requests(plain)
    alone = [plain.generate([p], q, use_tqdm=False)[0] for p, q in requests]
    together = busy.generate([p for p, _ in requests], [q for _, q in requests], use_tqdm=False)
    assert busy.engine.scheduler.num_preemptions > 0 and busy.engine.spec_stats.accepted > 0
    differ = [i for i, (want, got) in enumerate(zip(alone, together))
              if [c.token_ids for c in got.outputs] != [c.token_ids for c in want.outputs]]
    # The CPU's matmuls round differently at other batch sizes (in the last bit); a key that close
    # to an e4m3 rounding edge is stored one step apart, and a greedy tie can then break the other
    # way. With the FP8 cache at most 2 of the 7 requests may differ (2026-12-02: 1, the JSON one).
    assert not differ if kv_cache_dtype == "auto" else len(differ) <= 2, differ
    jsonschema.validate(json.loads(together[1].outputs[0].text), SCHEMAS[0])
    assert banned not in together[3].outputs[0].token_ids
    assert_no_leaks(busy)


# The 16-bit cache in batch-invariant mode is tests/engine/test_batch_invariant.py's (alone, together, under load).
@pytest.mark.parametrize("kv_cache_dtype", ["fp8"])
def test_features_together_batch_invariant(smollm, kv_cache_dtype):
    """The busy run without speculation (which batch-invariant mode refuses): grammars, bad words,
    allowed tokens, n = 2 with prompt logprobs, a seeded sampled request, chunked prefill,
    preemption, the prefix cache and a step-time target, in batch-invariant mode (with the FP8 KV
    cache too): each request's tokens and logprobs are bit for bit its run alone, where the default
    mode allows FP8-cache runs to differ (test_features_together_with_fp8_weights)."""
    plain = make_llm(smollm, batch_invariant=True, kv_cache_dtype=kv_cache_dtype)
    busy = make_llm(smollm, batch_invariant=True, kv_cache_dtype=kv_cache_dtype, step_time_target_ms=20.0,
                    **{k: v for k, v in BUSY.items() if k != "speculative_config"})
    requests, _, banned = feature_requests(plain)
    animals = requests[3][0]
    requests.append((animals, SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=24, logprobs=3)))
    alone = [plain.generate([p], q, use_tqdm=False)[0] for p, q in requests]
    together = busy.generate([p for p, _ in requests], [q for _, q in requests], use_tqdm=False)
    assert busy.engine.scheduler.num_preemptions > 0

    def result(out):
        return [(c.token_ids, c.logprobs and [{t: lp.logprob for t, lp in pos.items()} for pos in c.logprobs])
                for c in out.outputs]

    for want, got in zip(alone, together):
        assert result(got) == result(want)
    assert together[5].prompt_logprobs == alone[5].prompt_logprobs
    jsonschema.validate(json.loads(together[1].outputs[0].text), SCHEMAS[0])
    assert banned not in together[3].outputs[0].token_ids
    assert_no_leaks(busy)
