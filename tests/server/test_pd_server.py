"""Prefill/decode disaggregation through processes: a prefill `tokenmill serve` (SharedStorageConnector,
kv_producer), a decode one (kv_consumer, n-gram speculation) and `tokenmill proxy` in front. With
the real openai client, greedy answers through the proxy (completions and chat, streamed or not, one
under a JSON schema) equal one engine's; a client that leaves during the prefill or mid-stream
leaves no block held on either engine (from each one's /metrics); killing the prefill engine
mid-request gives the client an error and later requests a 503 within 10 s. The mechanics in
process: tests/engine/test_pd_disagg.py."""

import json
import signal
import threading
import time

import httpx
import pytest

from tests.server.conftest import SMALL_ENGINE, ServerProcess

openai = pytest.importorskip("openai")

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
CONTEXT = ("The tide rose over the harbour wall while the fishing boats came home one by one, their lamps "
           "swinging in the dusk. ")
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
          "additionalProperties": False}
LONG_PROMPT = CONTEXT * 40  # ~1,000 tokens: its prefill takes four CPU steps of 256 prompt tokens


def connector(path, role: str) -> list[str]:
    return ["--kv-transfer-config", json.dumps({"kv_connector": "SharedStorageConnector", "kv_role": role,
                                                "kv_connector_extra_config": {"path": str(path)}})]


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    """(prefill server, decode server, proxy), started together; the last test kills the prefill one."""
    path = tmp_path_factory.mktemp("kv")
    # Each engine on its API server's thread: three processes to start instead of five on 2 cores
    # (the engine process is tests/server/test_engine_process.py's subject, not this file's).
    engine = SMALL_ENGINE + ["--no-engine-process"]
    prefill = ServerProcess(engine + connector(path, "kv_producer"))
    decode = ServerProcess(engine + ["--speculative-config", json.dumps(NGRAM)] + connector(path, "kv_consumer"))
    proxy = ServerProcess(["--prefill", prefill.url, "--decode", decode.url], command="proxy")
    try:
        for p in (prefill, decode, proxy):  # (the proxy's /health is 200 once both engines' are)
            p.wait_ready()
        yield prefill, decode, proxy
    finally:
        for p in (proxy, decode, prefill):
            p.stop()


def client(server) -> "openai.OpenAI":
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)


def answers(server) -> list:
    """Greedy answers of one server: a completion, a streamed chat, a chat under a JSON schema."""
    c = client(server)
    model = c.models.list().data[0].id
    text = c.completions.create(model=model, prompt=CONTEXT + "Describe the harbour:", max_tokens=12,
                                temperature=0).choices[0].text
    messages = [{"role": "user", "content": "Repeat the first sentence below word for word. " + CONTEXT}]
    chunks = c.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0, stream=True)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    structured = c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Answer in JSON: which city is the capital of France? "
                                                           + CONTEXT}],
        max_tokens=16, temperature=0, response_format=schema).choices[0].message.content
    return [text, streamed, structured]


def test_greedy_through_the_proxy_equals_one_engine(pd):
    prefill, decode, proxy = pd
    reference = answers(prefill)  # the prefill engine alone is one whole engine
    assert json.loads(reference[2])["city"]
    assert answers(proxy) == reference
    produced, consumed = prefill.metrics(), decode.metrics()
    assert produced["tokenmill:kv_transfer_blocks_saved_total"] > 0
    # Every prompt's full blocks but its last token's came over (less what the decode engine had cached:
    # the chat prompts share their first block): 7 blocks of 16.
    assert consumed["tokenmill:kv_transfer_loaded_tokens_total"] == 7 * 16
    assert consumed["tokenmill:kv_transfer_failed_loads_total"] == 0
    assert consumed["tokenmill:spec_decode_num_drafts_total"] > 0  # the decode engine speculated on them


def model_of(server) -> str:
    return httpx.get(server.base_url + "/models", timeout=10).json()["data"][0]["id"]


def test_a_client_that_leaves_frees_the_blocks_on_both_engines(pd):
    prefill, decode, proxy = pd
    body = {"model": model_of(proxy), "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    # Gone during the prefill: the proxy's request to the prefill engine is closed, which aborts it there.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(proxy.base_url + "/completions", json={**body, "prompt": "Once " + LONG_PROMPT}, timeout=0.5)
    # Gone mid-stream: the decode engine's request is aborted.
    events = 0
    with httpx.stream("POST", proxy.base_url + "/completions", json={**body, "prompt": "Twice", "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break
    for server in (prefill, decode):
        m = server.wait_idle(timeout=30)
        assert m["tokenmill:kv_cache_usage_perc"] == 0 and m["tokenmill:num_requests_running"] == 0, server.url
        assert m["tokenmill:num_kv_blocks_free"] == m["tokenmill:num_kv_blocks"]
    assert prefill.metrics()["tokenmill:request_success_total{abort}"] >= 1
    assert decode.metrics()["tokenmill:request_success_total{abort}"] >= 1


def test_a_killed_prefill_engine_is_an_error_then_503(pd):
    """(Last in the module: the prefill engine stays dead.)"""
    prefill, decode, proxy = pd
    model = model_of(proxy)
    got = {}

    def send() -> None:
        got["response"] = httpx.post(proxy.base_url + "/completions", timeout=60, json={
            "model": model, "prompt": "Thrice " + LONG_PROMPT, "max_tokens": 4})

    sender = threading.Thread(target=send)
    sender.start()
    deadline = time.monotonic() + 30
    while prefill.metrics()["tokenmill:num_requests_running"] == 0:  # its prefill is under way
        assert time.monotonic() < deadline, "the prefill never started"
        time.sleep(0.05)
    prefill.signal(signal.SIGKILL)
    killed = time.monotonic()
    sender.join(30)
    r = got["response"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "prefill_unavailable", r.text
    assert "prefill engine" in r.json()["error"]["message"]
    prefill.wait(10)
    r = httpx.post(proxy.base_url + "/completions", timeout=10,
                   json={"model": model, "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 503 and "unreachable" in r.json()["error"]["message"], r.text
    assert time.monotonic() - killed < 10
    health = httpx.get(proxy.url + "/health", timeout=10)
    assert health.status_code == 503 and "prefill" in health.json()["error"]["message"]
    m = decode.wait_idle(timeout=10)  # the decode engine never saw the failed request
    assert m["tokenmill:kv_cache_usage_perc"] == 0
