"""The official `openai` client against `tokenmill serve` with the embedded model, plus a load test.

One server (the session's SMALL_ENGINE server: the model loads once). Generations are short: the embedded model decodes
only a few steps per second on a CPU.
"""

import asyncio

import httpx
import pytest

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"
PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(small_server):
    return small_server  # the session's SMALL_ENGINE server (tests/server/conftest.py)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def collect_completion_stream(stream) -> tuple[dict[int, str], dict[int, str], int]:
    texts, reasons, chunks = {}, {}, 0
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
            chunks += 1
    return texts, reasons, chunks


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(server.url + "/health").status_code == 200


def test_completion_greedy_stream_equals_non_stream(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    choice = full.choices[0]
    assert choice.text and choice.finish_reason in ("stop", "length")
    assert full.usage.prompt_tokens == 5
    assert full.usage.completion_tokens == len(choice.model_extra["token_ids"]) > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    texts, reasons, chunks = collect_completion_stream(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True))
    assert texts[0] == choice.text
    assert reasons[0] == choice.finish_reason
    assert chunks == full.usage.completion_tokens  # one chunk per generated token


def test_chat_greedy_stream_equals_non_stream_with_usage(client):
    full = client.chat.completions.create(model=MODEL, messages=QUESTION, max_completion_tokens=12, temperature=0)
    message = full.choices[0].message
    assert message.role == "assistant" and "Paris" in message.content
    assert full.usage.completion_tokens <= 12 and full.usage.prompt_tokens > 20
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    text, roles, usage, finish = "", [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.delta.role)
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert roles == ["assistant"]
    assert text == message.content
    assert finish == full.choices[0].finish_reason
    assert usage is not None and usage.model_dump() == full.usage.model_dump()


def test_n2_stop_and_seed(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=1.0, n=2, seed=1234)
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # same seed, same samples
    assert a.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in a.choices)
    other = client.completions.create(**dict(kwargs, seed=4321))
    assert [c.text for c in other.choices] != [c.text for c in a.choices]

    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, n=2, seed=7)
    assert sorted(c.index for c in chat.choices) == [0, 1]

    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    stop = greedy.strip().split()[1]  # a word from the middle of the answer
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].model_extra["stop_reason"] == stop
    assert cut.choices[0].text == greedy[:greedy.index(stop)]


def test_logprobs(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and top[token] == pytest.approx(value)
        assert value == pytest.approx(max(top.values()))  # greedy picks the most likely token

    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert 1 <= len(content) <= 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy
        assert bytes(entry.bytes).decode() == entry.token


def test_prompt_forms_and_echo(client):
    ids = [504, 3575, 282, 4649, 314]  # "The capital of France is"
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == by_text.choices[0].text[:len(batch.choices[0].text)]
    two_ids = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=3, temperature=0)
    assert len(two_ids.choices) == 2 and two_ids.usage.prompt_tokens == 8
    echo = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert echo.choices[0].text == PROMPT + by_text.choices[0].text


def test_errors_through_the_client(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=10**9)
    with pytest.raises(openai.BadRequestError, match="greater than or equal to 1"):
        client.completions.create(model=MODEL, prompt="x", n=-1)


def test_greedy_matches_llm_generate(client, smollm):
    """The server's greedy output equals LLM.generate's for the same prompts (the server runs in its
    own process, so this process may bind its own engine to the model)."""
    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    served = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    served_chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0)
    llm = LLM.from_engine(LLMEngine(config=EngineConfig(num_kv_blocks=512, max_num_seqs=64), loaded=smollm))
    params = SamplingParams(max_tokens=16, temperature=0)
    local = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    local_chat = llm.chat(QUESTION, params, use_tqdm=False)[0].outputs[0]
    assert served.choices[0].text == local.text
    assert served.choices[0].model_extra["token_ids"] == local.token_ids
    assert served_chat.choices[0].message.content == local_chat.text


def test_stop_strings_streamed_and_n2_match_llm_generate(client, smollm):
    """Stop strings (found off the engine thread in the server) give what LLM.generate gives, streamed
    or not, for two prompts with n=2; streams show no piece of a stop string and usage counts only
    the tokens sent. (tests/server/test_detokenize.py: a sample's stop does not end its sibling.)"""
    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    kwargs = dict(model=MODEL, prompt=["Once upon a time", PROMPT], max_tokens=12, temperature=0, n=2,
                  stop=[" the", "."])
    full = client.completions.create(**kwargs)
    usage_chunks = []
    texts, reasons, chunks = {}, {}, 0
    for chunk in client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage_chunks.append(chunk.usage)
        for choice in chunk.choices:
            assert not any(stop in texts.get(choice.index, "") + choice.text for stop in kwargs["stop"])
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
            chunks += 1
    llm = LLM.from_engine(LLMEngine(config=EngineConfig(num_kv_blocks=512, max_num_seqs=64), loaded=smollm))
    local = llm.generate(kwargs["prompt"], SamplingParams(max_tokens=12, temperature=0, n=2, stop=kwargs["stop"]),
                         use_tqdm=False)
    expected = [c for out in local for c in out.outputs]
    assert [c.text for c in full.choices] == [c.text for c in expected] == [texts[i] for i in range(4)]
    assert [c.finish_reason for c in full.choices] == [c.finish_reason for c in expected] == \
        [reasons[i] for i in range(4)]
    assert [c.model_extra["stop_reason"] for c in full.choices] == [c.stop_reason for c in expected]
    assert [c.model_extra["token_ids"] for c in full.choices] == [c.token_ids for c in expected]
    assert "stop" in reasons.values()
    sent = sum(len(c.token_ids) for c in expected)
    assert full.usage.completion_tokens == usage_chunks[-1].completion_tokens == chunks == sent


def test_non_streaming_client_disconnect_aborts(server):
    before = server.metrics()["tokenmill:request_success_total{abort}"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/completions", timeout=1.5,
                   json={"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True})
    after = server.wait_idle()
    assert after["tokenmill:request_success_total{abort}"] == before + 1
    assert after["tokenmill:kv_cache_usage_perc"] == 0


def test_load_64_streams_with_10_disconnects(server):
    """64 concurrent streaming clients; 10 disconnect mid-stream. The others get complete answers,
    then every KV block is free again and the server still answers."""
    max_tokens, quitters = 16, set(range(0, 64, 7))  # 10 clients: 0, 7, ..., 63
    assert len(quitters) == 10

    async def one(client, i: int):
        kwargs = dict(model=MODEL, max_tokens=max_tokens, temperature=0.8, seed=i, stream=True,
                      extra_body={"ignore_eos": True})
        if i % 2:
            stream = await client.chat.completions.create(
                messages=[{"role": "user", "content": f"Tell me a fact about the number {i}."}], **kwargs)
        else:
            stream = await client.completions.create(prompt=f"Fact {i}: the number {i} is", **kwargs)
        tokens, text, finish = 0, "", None
        async for chunk in stream:
            for choice in chunk.choices:
                tokens += len(choice.model_extra.get("token_ids") or [])
                text += (choice.delta.content or "") if i % 2 else choice.text
                finish = choice.finish_reason or finish
            if i in quitters and tokens >= 3:
                await stream.close()  # disconnect mid-stream
                return i, None, tokens
        return i, finish, tokens

    async def main():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    before = server.metrics()
    results = asyncio.run(main())
    for i, finish, tokens in results:
        if i in quitters:
            assert finish is None and tokens < max_tokens
        else:
            assert finish == "length" and tokens == max_tokens, (i, finish, tokens)
    after = server.wait_idle()
    assert after["tokenmill:kv_cache_usage_perc"] == 0
    assert after["tokenmill:num_kv_blocks_free"] == after["tokenmill:num_kv_blocks"]
    assert after["tokenmill:num_active_requests"] == 0
    aborted = after["tokenmill:request_success_total{abort}"] - before["tokenmill:request_success_total{abort}"]
    assert aborted == 10
    assert after["tokenmill:time_to_first_token_seconds_count"] >= 64
    assert after["tokenmill:inter_token_latency_seconds_count"] > 0
    # still serving
    r = httpx.post(server.base_url + "/completions", json={"prompt": PROMPT, "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) >= 1
    assert "Traceback" not in server.log()


# ---- structured output ------------------------------------------------------------------------
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_response_format_json_schema(client):
    import json

    import jsonschema

    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me a person as JSON."}], max_tokens=60,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=20, temperature=0,
                                       extra_body={"guided_choice": ["Paris", "Rome"]})
    assert r.choices[0].message.content in ("Paris", "Rome")
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0.7, seed=3,
                                  extra_body={"structured_outputs": {"regex": " [A-Z][a-z]{2,8}\\."}})
    import re

    assert re.fullmatch(" [A-Z][a-z]{2,8}\\.", r.choices[0].text)


def test_invalid_schema_is_a_400_and_the_server_keeps_serving(client):
    bad = {"type": "object", "properties": {"a": {"type": "intger"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": bad}})
    assert "json" in str(e.value)
    with pytest.raises(openai.BadRequestError, match="regex"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, extra_body={"guided_regex": "(a"})
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=20, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason in ("stop", "length")


# ---- bad_words and allowed_token_ids (vLLM's extra fields, in extra_body) ---------------------------
def _tokenize(server, text: str) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30)
    r.raise_for_status()
    return r.json()["tokens"]


def _complete_greedy(client, **extra) -> str:
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True, **extra})
    return out.choices[0].text


def test_bad_words_and_allowed_token_ids(server, client):
    plain = _complete_greedy(client)
    word = plain.split()[0].strip(".,!?")
    assert word
    banned = _complete_greedy(client, bad_words=[word])
    # The tokens before the word's last one are the plain run's; the word itself never comes out.
    assert banned != plain and banned.startswith(plain[: plain.index(word)])
    assert word not in banned.split()
    phrase = " ".join(plain.split()[:2])  # several tokens: banned through the device-side history
    assert len(_tokenize(server, " " + phrase)) > 1
    assert phrase not in _complete_greedy(client, bad_words=[phrase])
    allowed = _tokenize(server, " yes") + _tokenize(server, " no")
    assert len(allowed) == 2
    only = _complete_greedy(client, allowed_token_ids=allowed)
    assert only and only.replace(" yes", "").replace(" no", "") == ""


@pytest.mark.parametrize("extra, match", [
    ({"allowed_token_ids": []}, "must not be empty"),
    ({"allowed_token_ids": [10**8]}, "outside the vocabulary"),
    ({"bad_words": [""]}, "non-empty"),
])
def test_bad_sampling_values_are_400s(client, extra, match):
    with pytest.raises(openai.BadRequestError, match=match):
        _complete_greedy(client, **extra)
    assert _complete_greedy(client)  # and the server goes on
