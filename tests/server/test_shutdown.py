"""Graceful shutdown: SIGTERM/SIGINT during a streaming request -> the process exits 0."""

import json
import signal
import time

import httpx

from tests.server.conftest import SMALL_ENGINE


def _stream_then_signal(server, sig: int, max_tokens: int) -> tuple[list[str], float]:
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    events = []
    started = None
    try:
        with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                if len(events) == 2 and started is None:
                    server.signal(sig)
                    started = time.monotonic()
    except httpx.HTTPError:  # the server cut an aborted stream
        pass
    assert started is not None
    return events, started


def test_sigterm_aborts_a_long_stream_after_the_grace_period(start_server):
    server = start_server(SMALL_ENGINE + ["--shutdown-grace", "1"])
    events, started = _stream_then_signal(server, signal.SIGTERM, max_tokens=400)
    assert server.wait(timeout=60) == 0
    assert time.monotonic() - started < 30
    # cut short: the stream ends cleanly with an error event in OpenAI's format, then [DONE]
    assert events[-1] == "[DONE]"
    assert "shutting down" in json.loads(events[-2])["error"]["message"]
    assert len(events) < 100
    assert "Traceback" not in server.log()


def test_sigint_lets_a_short_stream_finish(start_server):
    server = start_server(SMALL_ENGINE + ["--shutdown-grace", "60"])
    events, _ = _stream_then_signal(server, signal.SIGINT, max_tokens=10)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert server.wait(timeout=60) == 0
    assert "Traceback" not in server.log()
