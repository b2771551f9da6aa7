"""Bad input never gets a 5xx: explicit cases with clear messages, the API key, the body bound, the
waiting-queue bound (in sequences), the per-request sequence limit, text that has no UTF-8 encoding,
the OpenAPI schema's error statuses, and a schemathesis fuzzing pass over that schema.

One server (embedded model) with a key, a short context (so every accepted request stays cheap),
a small body limit, a small batch (4 sequences run at once) and a small waiting bound (4 sequences).
"""

import json
import os
import re
import time

import httpx
import pytest

from tests.server.conftest import SMALL_ENGINE

KEY = "test-secret-key"
MAX_MODEL_LEN = 40
MAX_BODY = 100_000
MAX_WAITING = 4
MAX_NUM_SEQS = 4
MAX_SEQUENCES_PER_REQUEST = 256  # the server's default


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(SMALL_ENGINE + ["--max-model-len", str(MAX_MODEL_LEN), "--max-body-bytes", str(MAX_BODY),
                                        "--max-waiting", str(MAX_WAITING), "--max-num-seqs", str(MAX_NUM_SEQS)],
                        api_key=KEY)


def error_lines(log: str) -> list[str]:
    """Log records at ERROR or above (ours: "ERROR 12:00:00 name] ...", uvicorn's: "ERROR:    ...")."""
    return [line for line in log.splitlines() if re.match(r"(ERROR|CRITICAL)\b", line)]


def post(server, path: str, body=None, raw: bytes = None, headers=None, timeout: float = 60) -> httpx.Response:
    hdrs = dict(server.headers, **(headers or {}))
    if raw is not None:
        return httpx.post(server.url + path, content=raw, headers=dict(hdrs, **{"content-type": "application/json"}),
                          timeout=timeout)
    return httpx.post(server.url + path, json=body, headers=hdrs, timeout=timeout)


def assert_error(r: httpx.Response, status: int, *fragments: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for fragment in fragments:
        assert fragment in err["message"], (fragment, err["message"])
    return err


def test_api_key(server):
    openai = pytest.importorskip("openai")
    assert httpx.get(server.url + "/health").status_code == 200  # open without the key
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("GET", "/metrics"), ("GET", "/openapi.json"), ("GET", "/nope")]:
        r = httpx.request(method, server.url + path, json={"prompt": "x"})
        assert_error(r, 401, "API key")
        r = httpx.request(method, server.url + path, json={"prompt": "x"}, headers={"Authorization": "Bearer wrong"})
        assert_error(r, 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0, timeout=60).models.list()
    ok = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)
    assert ok.completions.create(model="smollm2-135m-instruct", prompt="Hi", max_tokens=2).choices


BAD_COMPLETIONS = [
    (b'{"prompt": "x", ', 400, "not valid JSON"),
    (b"", 400, "JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'"just a string"', 400, "JSON object"),
    ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"),
    ({"prompt": 5}, 400, "prompt: must be a string, a list of strings"),
    ({"prompt": [1, "a"]}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt must not be empty"),
    ({}, 400, "prompt"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "stream": "yes please"}, 400, "stream"),
    ({"prompt": "x", "max_tokens": 10**12}, 400, "context length"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "n": -1}, 400, "n: Input should be greater than or equal to 1"),
    ({"prompt": "x", "n": 0}, 400, "n:"),
    ({"prompt": "x", "n": 10**6}, 400, "n:"),
    ({"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "top_k": 10**20}, 400, "top_k"),
    ({"prompt": "x", "seed": 2**70}, 400, "seed"),
    ({"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ({"prompt": [10**9]}, 400, "outside the vocabulary"),
    ({"prompt": [-1]}, 400, "outside the vocabulary"),
    ({"prompt": "word " * 60}, 400, "context length"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 1000}}, 400, "logit_bias"),
    ({"prompt": "x", "stop_token_ids": [10**12]}, 400, "vocabulary"),
    ({"prompt": "x", "stop": [""]}, 400, "stop"),
    ({"prompt": "x", "stop": 7}, 400, "stop: must be a string or a list of strings"),
    ({"prompt": "x", "min_tokens": 30, "max_tokens": 5}, 400, "min_tokens"),
    ({"prompt": "x", "echo": True, "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "does not exist"),
]


@pytest.mark.parametrize("body,status,fragment", BAD_COMPLETIONS,
                         ids=[str(i) for i in range(len(BAD_COMPLETIONS))])
def test_bad_completion_requests(server, body, status, fragment):
    r = post(server, "/v1/completions", raw=body) if isinstance(body, bytes) else post(server, "/v1/completions", body)
    assert_error(r, status, fragment)


BAD_CHATS = [
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": 3}]}, "content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "text content"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs needs logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10**9}, "context length"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}, "json_schema"),
    ({"messages": [{"role": "user", "content": "x"}], "guided_regex": "(open"}, "regex"),
    ({"messages": [{"role": "user", "content": "x"}], "guided_choice": ["a"], "guided_regex": "a"}, "only one"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tool"),
    ({"messages": [{"role": "user", "content": "word " * 60}]}, "context length"),
]


@pytest.mark.parametrize("body,fragment", BAD_CHATS, ids=[str(i) for i in range(len(BAD_CHATS))])
def test_bad_chat_requests(server, body, fragment):
    assert_error(post(server, "/v1/chat/completions", body), 400, fragment)


def test_other_errors(server):
    r = httpx.get(server.url + "/v1/models/nope", headers=server.headers)
    assert_error(r, 404)
    r = httpx.get(server.url + "/v1/nothing-here", headers=server.headers)
    assert_error(r, 404)
    r = httpx.put(server.url + "/v1/completions", headers=server.headers, json={})
    assert_error(r, 405)
    big = json.dumps({"prompt": "x" * (MAX_BODY + 10)}).encode()
    assert_error(post(server, "/v1/completions", raw=big), 413, "larger than the limit")

    def chunks():  # no Content-Length: the bound is enforced while reading
        for _ in range(20):
            yield b" " * 10_000
    r = httpx.post(server.url + "/v1/completions", content=chunks(), headers=server.headers)
    assert_error(r, 413)
    # a form content type is still read as JSON
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "Hi", "max_tokens": 2}',
                   headers=dict(server.headers, **{"content-type": "application/x-www-form-urlencoded"}), timeout=60)
    assert r.status_code == 200, r.text


def _first_event(lines) -> str:
    for line in lines:
        if line.startswith("data: "):
            return line


def test_overload_gets_503_with_retry_after(server):
    """Past --max-waiting waiting sequences (prompts x n), new requests get 503 + Retry-After; the
    rest are served."""
    def stream(n: int, max_tokens: int):
        body = {"prompt": "Count: 1, 2, 3,", "max_tokens": max_tokens, "n": n, "ignore_eos": True, "stream": True}
        return httpx.stream("POST", server.base_url + "/completions", json=body, headers=server.headers, timeout=120)

    with stream(MAX_NUM_SEQS, 12) as running:
        assert running.status_code == 200
        running_lines = running.iter_lines()
        assert _first_event(running_lines)  # a token came: its 4 sequences run (all --max-num-seqs)
        with stream(MAX_WAITING, 4) as waiting:  # 4 sequences wait now: the bound
            assert waiting.status_code == 200
            r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
            err = assert_error(r, 503, "overloaded", "4 sequences waiting")
            assert err["code"] == "server_overloaded" and r.headers["retry-after"] == "1"
            lines = [line for line in waiting.iter_lines() if line.startswith("data: ")]
        lines += [line for line in running_lines if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    finished = [c for line in lines if line != "data: [DONE]" for c in json.loads(line[6:])["choices"]
                if c["finish_reason"]]
    assert len(finished) == MAX_NUM_SEQS + MAX_WAITING
    assert post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_sequence_limits(server):
    """Sequences (prompts x n) are counted: more than --max-waiting in one request can never be
    queued (400), more than max_sequences_per_request is refused at once (400 naming the limit)."""
    r = post(server, "/v1/completions", {"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 2})
    assert_error(r, 400, "6 sequences (3 prompt(s) x n=2)", f"the {MAX_WAITING}")
    r = post(server, "/v1/completions", {"prompt": "x", "n": MAX_WAITING + 1, "max_tokens": 2})
    assert_error(r, 400, f"{MAX_WAITING + 1} sequences")
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 5})
    assert_error(r, 400, "5 sequences")
    too_many = MAX_SEQUENCES_PER_REQUEST + 1
    r = post(server, "/v1/completions", {"prompt": ["x"] * too_many, "max_tokens": 2})
    err = assert_error(r, 400, f"{too_many} sequences", f"at most {MAX_SEQUENCES_PER_REQUEST} per request",
                       "max_sequences_per_request")
    assert err["param"] == "prompt" and err["code"] == "too_many_sequences"
    r = post(server, "/v1/completions", {"prompt": ["x", "y", "z"], "n": 100, "max_tokens": 2})
    assert_error(r, 400, "300 sequences (3 prompt(s) x n=100)", f"at most {MAX_SEQUENCES_PER_REQUEST}")
    r = post(server, "/v1/completions", {"prompt": ["x", "y"], "n": 2, "max_tokens": 2})  # 4: fits
    assert r.status_code == 200 and len(r.json()["choices"]) == 4


SURROGATES = [  # JSON's \ud800-style escapes decode to lone surrogates, which UTF-8 cannot encode
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', 400, "the prompt cannot be encoded as UTF-8"),
    ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', 400, "cannot be encoded as UTF-8"),
    ("/v1/completions", b'{"prompt": "a", "stop": ["\\ud800"], "max_tokens": 2}', 400,
     "a stop string cannot be encoded"),
    ("/v1/completions", b'{"prompt": "a", "model": "\\ud800"}', 404, "does not exist"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 2}', 400,
     "messages[0].content cannot be encoded as UTF-8"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi", "name": "\\udc80"}], "stream": true}',
     400, "messages[0].name cannot be encoded"),
]


@pytest.mark.parametrize("path,raw,status,fragment", SURROGATES, ids=[str(i) for i in range(len(SURROGATES))])
def test_text_without_utf8_encoding(server, path, raw, status, fragment):
    before = server.log()
    err = assert_error(post(server, path, raw=raw), status, fragment)
    if status == 400:
        assert "surrogates not allowed" in err["message"]
    new_log = server.log()[len(before):]
    assert not error_lines(new_log) and "Traceback" not in new_log, new_log
    assert post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_openapi_documents_the_real_error_statuses(server):
    schema = httpx.get(server.url + "/openapi.json", headers=server.headers).json()
    assert '"422"' not in json.dumps(schema) and "HTTPValidationError" not in schema["components"]["schemas"]
    error_model = schema["components"]["schemas"]["ErrorResponse"]
    assert error_model["properties"]["error"]["$ref"].endswith("/ErrorInfo")
    info = schema["components"]["schemas"]["ErrorInfo"]["properties"]
    assert {"message", "type", "param", "code"} <= set(info)
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "400", "401", "404", "413", "503"}, responses
        for status in ("400", "401", "404", "413", "503"):
            assert responses[status]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert set(schema["paths"]["/v1/models/{model_id}"]["get"]["responses"]) == {"200", "401", "404"}
    assert set(schema["paths"]["/health"]["get"]["responses"]) == {"200", "503"}  # open: no key asked
    # and the server does answer 400 (not 422) for a body the schema rejects
    assert_error(post(server, "/v1/completions", {"prompt": 5}), 400)


def _tame(case) -> None:
    """Keep accepted requests cheap on a CPU: values that would be valid but costly (many choices,
    long generations) are scaled down; invalid ones are left alone, so their 4xx paths still run."""
    body = case.body
    if not isinstance(body, dict):
        return
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and 2 < n <= 128:
        body["n"] = 2
    for name in ("max_tokens", "max_completion_tokens"):
        v = body.get(name)
        if isinstance(v, int) and not isinstance(v, bool) and 6 < v < MAX_MODEL_LEN:
            body[name] = 6


def test_fuzz_openapi_schema(server):
    """schemathesis over every operation of /openapi.json, schema-valid and schema-invalid inputs:
    no 5xx, and the server is still healthy and idle afterwards."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", headers=server.headers)
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= paths
    seen: dict[tuple, set] = {}
    examples = int(os.environ.get("TOKENMILL_FUZZ_EXAMPLES", "30"))  # per POST operation and mode
    started = time.monotonic()
    for op in operations:
        modes = [schemathesis.GenerationMode.POSITIVE]
        if op.method.upper() == "POST" or "{" in op.path:
            modes.append(schemathesis.GenerationMode.NEGATIVE)
        for mode in modes:
            statuses = seen.setdefault((op.method.upper(), op.path, mode.value), set())

            @settings(max_examples=examples if op.method.upper() == "POST" else 10, deadline=None, database=None,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def check(case):
                _tame(case)
                response = case.call(base_url=server.url, headers=server.headers, timeout=120)
                statuses.add(response.status_code)
                assert response.status_code < 500, (
                    f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}\n"
                    f"body: {case.body!r}"[:2000])

            try:
                check()
            except Unsatisfiable:
                # e.g. no schema-invalid value exists for a plain string path parameter
                assert mode == schemathesis.GenerationMode.NEGATIVE, (op.method, op.path)
                statuses.add("none generated")
    print(f"fuzzed in {time.monotonic() - started:.0f} s:", {k: sorted(map(str, v)) for k, v in seen.items()})
    assert server.proc.poll() is None
    assert httpx.get(server.url + "/health").status_code == 200
    assert server.wait_idle()["tokenmill:kv_cache_usage_perc"] == 0
    assert "Traceback" not in server.log()
