"""The engine in a process of its own under `tokenmill serve` (the default):

- killing the engine process mid-request gives the streaming client an error, and the server then
  answers 503 (health and new requests) within 10 s;
- SIGTERM still exits 0, and the engine process ends with the server;
- killing the server process ends the engine process too (it watches its parent);
- the engine process's garbage collections reach /metrics.
"""

import json
import os
import re
import signal
import time

import httpx
import pytest

from tests.server.conftest import SMALL_ENGINE, stream_and_kill


def _engine_pid(server) -> int:
    m = re.search(r"engine process (\d+) ready", server.log())
    assert m, server.log()[-2000:]
    return int(m.group(1))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped) is gone for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_killing_the_engine_process_mid_request(start_server):
    server = start_server(SMALL_ENGINE)
    pid = _engine_pid(server)
    assert pid != server.proc.pid and _alive(pid)
    body = {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    events, killed_at = stream_and_kill(server, body, pid)
    ended = time.monotonic() - killed_at
    assert ended < 10
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "engine process" in error["message"] and "killed by signal 9" in error["message"], error
    # Afterwards: 503 from health and from new requests, with a message that says why.
    deadline = killed_at + 10
    status = None
    while time.monotonic() < deadline:
        status = httpx.get(server.url + "/health", timeout=5).status_code
        if status == 503:
            break
        time.sleep(0.2)
    assert status == 503
    r = httpx.post(server.base_url + "/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
    assert r.status_code == 503
    assert "engine process" in r.json()["error"]["message"]
    assert "the engine is gone" in server.log()
    assert server.stop() == 1  # the engine failed: not a clean exit


def test_sigterm_exits_0_and_ends_the_engine_process(start_server):
    server = start_server(SMALL_ENGINE)
    pid = _engine_pid(server)
    r = httpx.post(server.base_url + "/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert "tokenmill:engine_gc_pause_seconds" in metrics
    server.signal(signal.SIGTERM)
    assert server.wait(timeout=60) == 0
    assert _wait_gone(pid, 10)
    assert "Traceback" not in server.log()


def test_killing_the_server_ends_the_engine_process(start_server):
    server = start_server(SMALL_ENGINE)
    pid = _engine_pid(server)
    server.proc.kill()
    server.proc.wait(timeout=10)
    assert _wait_gone(pid, 10), "the engine process outlived its server"


@pytest.mark.parametrize("flag", ["--no-engine-process"])
def test_the_engine_on_a_thread_still_serves(start_server, flag):
    server = start_server(SMALL_ENGINE + [flag])
    assert "engine process" not in server.log()
    r = httpx.post(server.base_url + "/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_two_api_servers_share_the_port_and_the_engine(start_server):
    server = start_server(SMALL_ENGINE + ["--api-server-count", "2"])
    deadline = time.monotonic() + 60
    while "API server 1 of 2 ready" not in server.log():
        assert time.monotonic() < deadline, server.log()[-2000:]
        time.sleep(0.2)
    child = int(re.search(r"API server 1 of 2 ready \(pid (\d+)\)", server.log()).group(1))
    engine = _engine_pid(server)
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    def one(_):
        with httpx.Client() as c:  # a connection of its own: either process may accept it
            return c.post(server.base_url + "/completions", json=body, timeout=60).json()

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(one, range(32)))
    texts = {a["choices"][0]["text"] for a in answers}
    assert len(texts) == 1 and all(a["usage"]["completion_tokens"] == 8 for a in answers)
    server.signal(signal.SIGTERM)
    assert server.wait(timeout=60) == 0
    assert _wait_gone(child, 10) and _wait_gone(engine, 10)
    log = server.log()
    assert "Traceback" not in log and "leaked" not in log and "second signal" not in log
