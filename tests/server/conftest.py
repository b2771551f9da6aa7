"""Server test helpers: start `tokenmill serve` as a real subprocess on a free loopback port."""

import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

# Small engine settings: the embedded model decodes only a few steps per second on a CPU.
SMALL_ENGINE = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "512", "--max-num-seqs", "64"]

# Servers not yet stopped: a failing test's report carries their logs' tails (a stall shows where).
LIVE_SERVERS: list["ServerProcess"] = []


def free_port() -> int:
    """A free port below the ephemeral range: a server binds it seconds later (after loading), and an
    ephemeral port could meanwhile go to another socket (a worker's gloo connection took one once)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            first_ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 32768
    for _ in range(200):
        port = random.randint(10000, first_ephemeral - 1)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], api_key: Optional[str] = None, env: Optional[dict] = None,
                 command: str = "serve"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        self.api_key = api_key
        self.log_file = tempfile.NamedTemporaryFile("w+", prefix="tokenmill-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli", command, *args, "--port", str(self.port)]
        if api_key:
            cmd += ["--api-key", api_key]
        full_env = dict(os.environ, **(env or {}))
        full_env.pop("TOKENMILL_API_KEY", None)
        self.proc = subprocess.Popen(cmd, stdout=self.log_file, stderr=subprocess.STDOUT, env=full_env)
        LIVE_SERVERS.append(self)

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        with open(self.log_file.name) as f:
            return f.read()

    def wait_ready(self, timeout: float = 300.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"the server did not become ready in {timeout:.0f} s:\n{self.log()[-4000:]}")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> Optional[int]:
        if self in LIVE_SERVERS:
            LIVE_SERVERS.remove(self)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_file.close()
        return self.proc.returncode

    # ---- helpers ----------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """The /metrics samples, by name (labels dropped; first sample of each name)."""
        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=10).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            m = re.match(r"^([^{\s]+)(\{[^}]*\})?\s+(\S+)$", line)
            if m:
                key = m.group(1)
                if "finished_reason=" in (m.group(2) or ""):
                    key += "{" + re.search(r'finished_reason="(\w+)"', m.group(2)).group(1) + "}"
                values.setdefault(key, float(m.group(3)))
        return values

    def wait_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """Wait until no request runs or waits and the KV cache is empty; returns the metrics then."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["tokenmill:num_active_requests"] == 0 and m["tokenmill:num_requests_running"] == 0
                    and m["tokenmill:num_requests_waiting"] == 0 and m["tokenmill:kv_cache_usage_perc"] == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.2)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.failed and LIVE_SERVERS:
        dump_stacks(LIVE_SERVERS)
        for server in LIVE_SERVERS:
            report.sections.append((f"server log, port {server.port} (tail)", server.log()[-12000:]))


def dump_stacks(servers: list[ServerProcess]) -> None:
    """Have every live server and its engine processes write their threads' stacks to their logs."""
    import psutil

    for server in servers:
        try:
            procs = [psutil.Process(server.proc.pid)]
            procs += procs[0].children(recursive=True)
        except psutil.Error:
            continue
        for proc in procs:  # only those that catch it (the default action ends a process)
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    caught = int(next(line for line in f if line.startswith("SigCgt:")).split()[1], 16)
                if caught >> (signal.SIGUSR1 - 1) & 1:
                    proc.send_signal(signal.SIGUSR1)
            except (OSError, StopIteration, psutil.Error):
                pass
    time.sleep(1.0)


@pytest.fixture(scope="module")
def start_server():
    """Start servers for a module; all are stopped at its end."""
    servers: list[ServerProcess] = []

    def start(args: list[str], api_key: Optional[str] = None, env: Optional[dict] = None) -> ServerProcess:
        server = ServerProcess(args, api_key=api_key, env=env)
        servers.append(server)
        return server.wait_ready()

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def small_server():
    """One `tokenmill serve` with SMALL_ENGINE alone (no other flag) for the session: the modules
    that need exactly that server share it (tests/server/test_openai_client.py and the server
    without speculation of tests/server/test_spec_decode_server.py). Tests must not stop it."""
    server = ServerProcess(SMALL_ENGINE)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="session")
def chunked_server():
    """One SMALL_ENGINE server with an 8-token step budget (prompts prefill in chunks) for the
    session: tests/server/test_prompt_logprobs_server.py and tests/server/test_lm_eval.py share it
    (prompt logprobs across chunks). Tests must not stop it."""
    server = ServerProcess(SMALL_ENGINE + ["--max-num-batched-tokens", "8"])
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def stream_and_kill(server, body: dict, pid: int, after_events: int = 3) -> tuple[list[str], float]:
    """Stream a /completions request and SIGKILL process `pid` once `after_events` events came;
    returns the stream's data events (to its end) and when the kill happened (time.monotonic)."""
    import os
    import signal
    import time

    import httpx

    events, killed_at = [], None
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        try:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                if len(events) == after_events and killed_at is None:
                    os.kill(pid, signal.SIGKILL)
                    killed_at = time.monotonic()
        except httpx.HTTPError:
            pass
    assert killed_at is not None, "the stream ended before the kill"
    return events, killed_at
