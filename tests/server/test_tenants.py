"""Tenants of one server, tried as an attacker would: tenant B probes /metrics and the prefix cache
for what tenant A sent; then the input bounds (a 4 MB prompt, float32 overflow, strict token ids,
echoed names) and that every refusal is counted.

One server (embedded model): two API keys, --cache-salt-by-api-key and a metrics key. Prefix-cache
hits are read from the hit rate only the metrics key sees: a request with no cached blocks lowers the
cumulative rate, one that reuses its prompt's blocks raises it.
"""

import re
import time
import uuid

import httpx
import pytest

from tests.server.conftest import SMALL_ENGINE
from tokenmill.config import ConfigError

KEY_A = "tenant-a-key"
KEY_B = "tenant-b-key"
METRICS_KEY = "operator-metrics-key"
HIT_RATE = "tokenmill:prefix_cache_hit_rate"
PREFIX_CACHE_SERIES = ("tokenmill:prefix_cache_hit_rate", "tokenmill:replica_prefix_cache_hit_rate",
                       "tokenmill:replica_requests_routed_by_prefix", "tokenmill:replica_prompt_tokens_computed")


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(SMALL_ENGINE + ["--api-key", KEY_B, "--cache-salt-by-api-key",
                                        "--metrics-api-key", METRICS_KEY], api_key=KEY_A)


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def post(server, path: str, body: dict, key: str = KEY_A, timeout: float = 60) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=auth(key), timeout=timeout)


def metrics_text(server, key: str) -> str:
    r = httpx.get(server.url + "/metrics", headers=auth(key), timeout=10)
    assert r.status_code == 200, r.text
    return r.text


def sample(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$", text, re.M)
    assert m, (name, labels)
    return float(m.group(1))


def hit_rate(server) -> float:
    return sample(metrics_text(server, METRICS_KEY), HIT_RATE)


def secret_prompt() -> str:
    """A prompt of a few KV blocks (16 tokens each) that no other test sends."""
    return (f"Project {uuid.uuid4().hex[:6]}: the launch code is 4417, and the vault opens at dawn on the first day "
            "of the month, when the guards change.")


def complete(server, key: str, prompt: str, **extra) -> None:
    r = post(server, "/v1/completions", dict({"prompt": prompt, "max_tokens": 1, "temperature": 0}, **extra), key)
    assert r.status_code == 200, r.text


def rate_after(server, before: float, key: str, prompt: str, **extra) -> float:
    """The cumulative hit rate once this request's lookup is counted (every lookup moves it)."""
    complete(server, key, prompt, **extra)
    deadline = time.monotonic() + 20
    while (rate := hit_rate(server)) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    return rate


def test_tenant_metrics_carry_no_prefix_cache_signal(server):
    for key in (KEY_A, KEY_B):
        text = metrics_text(server, key)
        assert "tokenmill:num_requests_running" in text
        assert not [name for name in PREFIX_CACHE_SERIES if name in text]
    assert HIT_RATE in metrics_text(server, METRICS_KEY)
    # The metrics key opens /metrics only.
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1}, METRICS_KEY).status_code == 401


def test_tenants_never_share_prefix_cache_blocks(server):
    secret = secret_prompt()
    complete(server, KEY_A, secret)
    rate = rate_after(server, hit_rate(server), KEY_A, secret)  # A's repeat reuses A's blocks
    after_b = rate_after(server, rate, KEY_B, secret)
    assert after_b < rate, "tenant B's probe found tenant A's prompt in the prefix cache"
    assert rate_after(server, after_b, KEY_B, secret) > after_b  # B's own repeat does hit


def test_client_cache_salt_adds_to_the_key_salt(server):
    prompt = secret_prompt()
    complete(server, KEY_A, prompt, cache_salt="x")
    rate = rate_after(server, hit_rate(server), KEY_A, prompt, cache_salt="x")
    for key, salt in [(KEY_A, "y"), (KEY_B, "x")]:  # another salt; another tenant's "x"
        lower = rate_after(server, rate, key, prompt, cache_salt=salt)
        assert lower < rate, (key, salt)
        rate = lower
    assert rate_after(server, rate, KEY_A, prompt, cache_salt="x") > rate


def test_cache_salt_must_be_a_non_empty_string(server):
    for salt in ["", 5, ["x"]]:
        r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                  "cache_salt": salt})
        assert r.status_code == 400 and "cache_salt" in r.json()["error"]["message"], r.text


def test_megabyte_prompts_are_refused_before_tokenizing(server):
    huge = "x " * 2_000_000  # 4 MB: tens of seconds to tokenize
    for path, body in [("/v1/completions", {"prompt": huge, "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge[:2_000_000]},
                                                              {"role": "user", "content": huge[:1_900_000]}]}),
                       ("/tokenize", {"prompt": huge})]:
        start = time.monotonic()
        r = post(server, path, body, timeout=30)
        elapsed = time.monotonic() - start
        assert r.status_code == 400 and "characters, more than the" in r.json()["error"]["message"], (path, r.text)
        assert elapsed < 5, (path, elapsed)  # JSON parsing only (tokenizing took 30-57 s)


@pytest.mark.parametrize("field,value", [("temperature", 1e308), ("temperature", 3.5e38),
                                         ("repetition_penalty", 1e300), ("min_p", 1e-45)])
def test_float_fields_must_fit_float32(server, field, value):
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, field: value})
    assert r.status_code == 400, r.text
    assert f"{field} must be representable as a 32-bit float" in r.json()["error"]["message"]


def test_every_refusal_is_counted_as_invalid(server):
    def invalid() -> float:
        return sample(metrics_text(server, KEY_A), "tokenmill:request_rejected_total", 'reason="invalid"')

    before = invalid()
    refusals = [
        ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}),  # the body's schema
        ("/v1/completions", {"prompt": "hi", "suffix": "x"}),  # the handler
        ("/v1/completions", {"prompt": "hi", "temperature": 1e308}),  # SamplingParams
        ("/v1/completions", {"prompt": [10**6]}),  # the engine's validation
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}),
        ("/detokenize", {"tokens": [True]}),
    ]
    for path, body in refusals:
        assert post(server, path, body).status_code == 400, (path, body)
    assert invalid() - before == len(refusals)


def test_token_ids_are_strict_integers(server):
    for tokens in ([True], ["0"], [1.0]):
        r = post(server, "/detokenize", {"tokens": tokens})
        assert r.status_code == 400 and "tokens.0" in r.json()["error"]["message"], (tokens, r.text)
    assert post(server, "/detokenize", {"tokens": [0]}).status_code == 200
    assert post(server, "/v1/completions", {"prompt": [True, False], "max_tokens": 1}).status_code == 400


def test_unknown_model_names_are_cut_in_the_404(server):
    long_name = "m" * 100_000
    r = post(server, "/v1/completions", {"prompt": "hi", "model": long_name})
    assert r.status_code == 404 and len(r.text) < 1000 and "(100000 characters)" in r.text, r.text[:300]
    r = httpx.get(server.url + "/v1/models/" + "m" * 5000, headers=auth(KEY_A), timeout=10)
    assert r.status_code == 404 and len(r.text) < 1000, r.text[:300]


def test_a_text_part_without_text_is_named(server):
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "content[0]: a text content part needs a `text` string" in message, message
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": ""}, {"type": "text", "text": "Hi"}]}], "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_unknown_fields_are_logged_once_per_name(server):
    field = f"misspelt_{uuid.uuid4().hex[:8]}"
    for _ in range(2):
        assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, field: 1}).status_code == 200
    lines = [line for line in server.log().splitlines() if field in line]
    assert len(lines) == 1 and lines[0].startswith("WARNING"), lines


def test_key_sources_and_settings(tmp_path):
    from tokenmill.entrypoints.serve_cli import resolve_api_keys
    from tokenmill.serve.openai.api_server import ServerSettings

    keys = tmp_path / "keys"
    keys.write_text(" k1 \n\nk2\nk1\n")
    assert resolve_api_keys(None, str(keys), {}) == ["k1", "k2"]
    assert resolve_api_keys(["a", " b "], None, {}) == ["a", "b"]
    with pytest.raises(ConfigError, match="--api-key is empty"):
        resolve_api_keys(["a", " "], None, {})
    with pytest.raises(ConfigError, match="needs API keys"):
        ServerSettings(cache_salt_by_api_key=True)
    with pytest.raises(ConfigError, match="--metrics-api-key must be a non-empty key of its own"):
        ServerSettings(api_keys=["a"], metrics_api_key="a")
