"""A model without a tokenizer (dummy weights, as benchmarks use) still serves token-id prompts."""

import json

import httpx
import pytest

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(["--model", MODEL, "--load-format", "dummy", "--device", "cpu", "--num-kv-blocks", "256",
                         "--max-num-seqs", "16", "--served-model-name", "tiny", "other-name"])


def test_token_id_prompts(server):
    body = {"model": "tiny", "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 7, "temperature": 0, "ignore_eos": True,
            "logprobs": 1}
    r = httpx.post(server.base_url + "/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for c in out["choices"]:
        assert c["text"] == "" and len(c["token_ids"]) == 7 and c["finish_reason"] == "length"
        assert all(t.startswith("token_id:") for t in c["logprobs"]["tokens"])
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 14, "total_tokens": 19}
    # the second served name works too
    r = httpx.post(server.base_url + "/completions", json=dict(body, model="other-name", prompt=[1, 2, 3]))
    assert r.json()["choices"][0]["token_ids"] == out["choices"][0]["token_ids"]


def test_stream_sends_one_chunk_per_token(server):
    body = {"prompt": [1, 2, 3], "max_tokens": 9, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    token_chunks = [c for c in chunks if c["choices"]]
    assert len(token_chunks) == 9
    assert all(len(c["choices"][0]["token_ids"]) == 1 for c in token_chunks)
    assert token_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 9


def test_text_needs_a_tokenizer(server):
    r = httpx.post(server.base_url + "/completions", json={"prompt": "hello"})
    assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"]
    r = httpx.post(server.base_url + "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
    models = httpx.get(server.base_url + "/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny", "other-name"]


def test_prefix_cache_reset_and_metrics(server):
    prompt = list(range(1, 50))  # three full blocks of 16
    for _ in range(2):
        r = httpx.post(server.base_url + "/completions", json={"prompt": prompt, "max_tokens": 2})
        assert r.status_code == 200
    text = httpx.get(server.url + "/metrics").text
    hit_rate = float(next(line.split()[-1] for line in text.splitlines()
                          if line.startswith("tokenmill:prefix_cache_hit_rate")))
    assert hit_rate > 0
    assert httpx.post(server.url + "/reset_prefix_cache").status_code == 200
