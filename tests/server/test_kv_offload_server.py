"""`tokenmill serve --kv-offloading-size`: through the engine process, a prompt evicted from the GPU
prefix cache comes back from the host tier with the same tokens, and /metrics counts the host hits."""

import re

import httpx
import pytest


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(["--model", "tiny-llama", "--load-format", "dummy", "--device", "cpu", "--num-kv-blocks",
                         "24", "--block-size", "8", "--max-num-seqs", "4", "--kv-offloading-size", "0.01"])


def complete(server, prompt: list[int], max_tokens: int = 4) -> list[int]:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}
    r = httpx.post(server.base_url + "/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_an_evicted_prefix_comes_back_from_the_host(server):
    prompt = list(range(100, 160))
    first = complete(server, prompt)
    for i in range(4):  # prompts that take every GPU block
        complete(server, [7 + 4 * i + j for j in range(60)], max_tokens=1)
    assert complete(server, prompt) == first
    assert metric(server, "tokenmill:kv_offload_hit_tokens_total") >= 56
    assert metric(server, "tokenmill:kv_offload_bytes_loaded_total") > 0
    assert metric(server, "tokenmill:kv_offload_num_blocks") > 0
