"""`tokenmill serve --tensor-parallel-size 3` (the embedded model, CPU, gloo): a request is served by
the three ranks, and killing a tensor-parallel worker mid-request gives the streaming client an error naming the worker
within 10 s (never a hang); with no engine restart allowed, the server then exits with status 1."""

import json
import re
import time

import httpx

from tests.server.conftest import SMALL_ENGINE, stream_and_kill


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def test_killing_a_worker_mid_request(start_server):
    server = start_server(["--tensor-parallel-size", "3", "--max-engine-restarts", "0", *SMALL_ENGINE])
    r = httpx.post(server.base_url + "/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    engine = int(re.search(r"engine process (\d+) ready", server.log()).group(1))
    workers = [p for p in _children(engine) if "tokenmill.executor.worker" in _cmdline(p)]
    assert len(workers) == 2, [(p, _cmdline(p)) for p in _children(engine)]
    body = {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    events, killed_at = stream_and_kill(server, body, workers[0])
    assert time.monotonic() - killed_at < 10
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "engine" in error["message"], error
    assert server.wait(30) == 1  # by itself: the engine failed, and no restart is allowed
