"""Invalid requests are refused with a clear error; the engine keeps serving the others."""

import pytest

from tests.engine.conftest import assert_no_leaks, make_llm
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm(smollm):
    return make_llm(smollm, num_kv_blocks=64, max_model_len=512)


BAD_PARAMS = [
    (dict(max_tokens=0), "max_tokens must be at least 1"),
    (dict(max_tokens=-3), "max_tokens must be at least 1"),
    (dict(top_p=0.0), "top_p must be in"),
    (dict(top_p=1.5), "top_p must be in"),
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(n=0), "n must be an integer >= 1"),
    (dict(logprobs=100), "logprobs must be an integer"),
    (dict(min_tokens=10, max_tokens=5), "min_tokens"),
    (dict(presence_penalty=5.0), "presence_penalty must be in"),
    (dict(stop=[""]), "stop must be a non-empty string"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(top_p=float("inf")), "top_p must be a finite number"),
    (dict(seed=2**64), "seed must be an integer in"),
    (dict(top_k=2**40), "top_k must be"),
    (dict(logit_bias={3: float("nan")}), "logit_bias values must be finite"),
    # The sampler holds these in float32: finite there, and non-zero if non-zero.
    (dict(temperature=1e308), "temperature must be representable as a 32-bit float"),
    (dict(temperature=3.5e38), "temperature must be representable as a 32-bit float"),
    (dict(temperature=1e-40), "temperature must be representable as a 32-bit float"),
    (dict(temperature=1e-35), "temperature must be 0 .greedy. or at least 1e-30"),
    (dict(repetition_penalty=1e300), "repetition_penalty must be representable"),
    (dict(min_p=1e-45), "min_p must be representable"),
    (dict(cache_salt=""), "cache_salt must be a non-empty string"),
    (dict(cache_salt=7), "cache_salt must be a non-empty string"),
]


@pytest.mark.parametrize("kwargs,message", BAD_PARAMS, ids=[str(k) for k, _ in BAD_PARAMS])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_prefill_tokens_with_decodes=0), "max_prefill_tokens_with_decodes must be >= 1, got 0"),
    (dict(max_num_seqs=0), "max_num_seqs must be >= 1"),
    (dict(piecewise_cuda_graph_max_tokens=-1), "piecewise_cuda_graph_max_tokens must be >= 0, got -1"),
])
def test_bad_engine_config(kwargs, message):
    from tokenmill.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match=message):
        EngineConfig(**kwargs).validate()


def test_unknown_field():
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'"):
        SamplingParams(temprature=0.5)
    with pytest.raises(InvalidRequestError, match="unknown sampling parameter.*temprature"):
        SamplingParams.from_dict({"temprature": 0.5, "max_tokens": 3})


def test_bad_requests_leave_the_engine_serving(llm):
    engine = llm.engine
    good = engine.add_request("Hello there", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    cases = [
        ("", SamplingParams(), "the prompt is empty"),
        ([], SamplingParams(), "the prompt is empty"),
        ("word " * 600, SamplingParams(), "context length is 512"),
        ("hi", SamplingParams(max_tokens=600), "exceeds the context length of 512"),
        ([1, 2, 10**7], SamplingParams(), "outside the vocabulary"),
        ("hi", SamplingParams(max_tokens=None, min_tokens=600), "min_tokens \\(600\\) exceeds"),
        ("hi", SamplingParams(logit_bias={10**7: 1.0}), "outside the vocabulary"),
        ("hi", {"temperature": 0}, "must be SamplingParams"),
        (3.14, SamplingParams(), "string or a list of token ids"),
    ]
    outputs = {}
    for prompt, params, message in cases:
        with pytest.raises(InvalidRequestError, match=message):
            engine.add_request(prompt, params)
        for o in engine.step():  # the good request keeps going between the failures
            outputs[o.request_id] = o
    while engine.has_unfinished_requests():
        for o in engine.step():
            outputs[o.request_id] = o
    for ids in ([5, 10**7], [-1], [True, 3]):  # token ids given directly are checked too
        with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
            engine.add_request(None, SamplingParams(), prompt_ids=ids)
    while engine.has_unfinished_requests():
        for o in engine.step():
            outputs[o.request_id] = o
    assert outputs[good].finished and len(outputs[good].outputs[0].token_ids) == 6
    assert_no_leaks(llm)


def test_request_needing_more_blocks_than_the_cache(smollm):
    llm = make_llm(smollm, num_kv_blocks=4, max_model_len=512)
    with pytest.raises(InvalidRequestError, match="needs 5 KV-cache blocks but the cache has only 4"):
        llm.generate(["hi"], SamplingParams(max_tokens=70))
    assert_no_leaks(llm)


def test_generate_validates_all_prompts_before_queueing(llm):
    with pytest.raises(InvalidRequestError, match="the prompt is empty"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2))
    assert_no_leaks(llm)
    out = llm.generate(["fine"], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
