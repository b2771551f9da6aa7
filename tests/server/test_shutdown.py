"""Shutdown of a real `tokenmill serve` process.

- SIGTERM/SIGINT during a streaming request: the grace period, then the stream is aborted cleanly;
  exit status 0.
- A second SIGTERM/SIGINT aborts what still runs at once: exit status 128 + that signal's number.
- No shutdown prints native leak reports ("nanobind: leaked ...") on stderr (an idle server's:
  tests/server/test_engine_process.py::test_sigterm_exits_0_and_ends_the_engine_process).
"""

import json
import signal
import time

import httpx
import pytest

from tests.server.conftest import SMALL_ENGINE


def _stream_then_signal(server, signals: list[int], max_tokens: int, pause: float = 0.0) -> tuple[list[str], float]:
    """Stream a completion; after its second event send `signals`, `pause` seconds apart. Returns the
    events and when the first signal went."""
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
                    started = time.monotonic()
                    for i, sig in enumerate(signals):
                        if i:
                            time.sleep(pause)
                        server.signal(sig)
    except httpx.HTTPError:  # the server cut an aborted stream
        pass
    assert started is not None
    return events, started


def _assert_clean_log(server) -> None:
    log = server.log()
    assert "Traceback" not in log
    assert "leaked" not in log, log[-3000:]  # nanobind's report of objects never freed at exit


def _assert_aborted_cleanly(events: list[str]) -> None:
    # cut short: the stream ends cleanly with an error event in OpenAI's format, then [DONE]
    assert events[-1] == "[DONE]"
    assert "shutting down" in json.loads(events[-2])["error"]["message"]
    assert len(events) < 100


def test_sigterm_aborts_a_long_stream_after_the_grace_period(start_server):
    server = start_server(SMALL_ENGINE + ["--shutdown-grace", "1"])
    events, started = _stream_then_signal(server, [signal.SIGTERM], max_tokens=400)
    assert server.wait(timeout=60) == 0
    assert time.monotonic() - started < 30
    _assert_aborted_cleanly(events)
    _assert_clean_log(server)


def test_sigint_lets_a_short_stream_finish(start_server):
    server = start_server(SMALL_ENGINE + ["--shutdown-grace", "60"])
    events, _ = _stream_then_signal(server, [signal.SIGINT], max_tokens=10)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert server.wait(timeout=60) == 0
    _assert_clean_log(server)


# One mixed pair: a repeated signal, or the pair the other way round, is the same code path (the exit
# status is 128 + the second signal's number either way).
@pytest.mark.parametrize("first,second", [(signal.SIGTERM, signal.SIGINT)], ids=["term-int"])
def test_a_second_signal_aborts_at_once_and_exits_non_zero(start_server, first, second):
    """With a grace period of 10 minutes, the second signal ends the wait: the stream is aborted
    (error event, then [DONE]) and the process is gone within seconds, with status 128 + signum."""
    server = start_server(SMALL_ENGINE + ["--shutdown-grace", "600"])
    events, started = _stream_then_signal(server, [first, second], max_tokens=2000, pause=0.5)
    assert server.wait(timeout=60) == 128 + second
    assert time.monotonic() - started < 30
    _assert_aborted_cleanly(events)
    log = server.log()
    assert f"second signal ({signal.Signals(second).name})" in log
    _assert_clean_log(server)
