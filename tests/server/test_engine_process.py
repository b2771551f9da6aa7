"""The engine in a process of its own under `tokenmill serve` (the default):

- killing the engine process mid-request gives the streaming client an error at once; the server
  restarts the engine process (its LoRA adapters loaded again, /metrics counting the restart) and
  serves again; killed once more with no restart left (--max-engine-restarts 1), the server exits
  with status 1 within seconds;
- SIGTERM still exits 0, and the engine process ends with the server;
- killing the server process ends the engine process too (it watches its parent);
- the engine process's garbage collections reach /metrics;
- API server processes never load torch (only the engine process does).
"""

import json
import os
import re
import signal
import time

import httpx
import pytest

from tests.lora_adapters import make_adapter
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


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_a_killed_engine_process_is_restarted_then_the_server_exits_1(start_server, hf_smollm, tmp_path_factory):
    adapter = make_adapter(hf_smollm, tmp_path_factory.mktemp("lora") / "ad", rank=4, seed=1)
    server = start_server(SMALL_ENGINE + ["--max-engine-restarts", "1", "--enable-lora", "--max-lora-rank", "8",
                                          "--lora-modules", f"ad={adapter}"])
    pid = _engine_pid(server)
    assert pid != server.proc.pid and _alive(pid)

    def with_adapter() -> list[int]:
        r = httpx.post(server.base_url + "/completions", json={"model": "ad", "prompt": "Hi", "max_tokens": 4,
                                                               "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    before = with_adapter()
    body = {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    events, killed_at = stream_and_kill(server, body, pid)
    assert time.monotonic() - killed_at < 10  # the stream ends at once, not after the restart
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "engine process" in error["message"] and "killed by signal 9" in error["message"], error
    # Restarted: healthy again, a new engine process, the adapter there again, the restart counted.
    deadline = killed_at + 120
    while httpx.get(server.url + "/health", timeout=5).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    m = re.search(r"engine process (\d+) ready after restart 1 of at most 1", server.log())
    assert m, server.log()[-3000:]
    new_pid = int(m.group(1))
    assert new_pid != pid and _alive(new_pid) and not _alive(pid)
    assert with_adapter() == before
    assert server.metrics()["tokenmill:engine_restarts_total"] == 1
    # Killed again with no restart left: the server exits 1 by itself, for its supervisor to restart it.
    os.kill(new_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    assert server.wait(30) == 1
    assert time.monotonic() - killed_at < 15
    assert "the server exits with status 1" in server.log()


def test_sigterm_exits_0_and_ends_the_engine_process(start_server):
    """An idle server (it never served a request: a served one's SIGTERM is tests/server/test_shutdown.py's)
    exits 0, its engine process ends, and neither prints a traceback or a native leak report."""
    server = start_server(SMALL_ENGINE)
    pid = _engine_pid(server)
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert "tokenmill:engine_gc_pause_seconds" in metrics
    server.signal(signal.SIGTERM)
    assert server.wait(timeout=60) == 0
    assert _wait_gone(pid, 10)
    log = server.log()
    assert "Traceback" not in log
    assert "leaked" not in log, log[-3000:]  # nanobind's report of objects never freed at exit


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

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(16)))
    texts = {a["choices"][0]["text"] for a in answers}
    assert len(texts) == 1 and all(a["usage"]["completion_tokens"] == 8 for a in answers)
    # start-up and memory: the API servers (both served requests) import no torch; the engine does
    assert not _maps_torch(server.proc.pid) and not _maps_torch(child) and _maps_torch(engine)
    server.signal(signal.SIGTERM)
    assert server.wait(timeout=60) == 0
    assert _wait_gone(child, 10) and _wait_gone(engine, 10)
    log = server.log()
    assert "Traceback" not in log and "leaked" not in log and "second signal" not in log
