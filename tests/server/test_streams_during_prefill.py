"""A running stream keeps receiving tokens while the server takes in a long prompt.

One server with a small per-step token budget (--max-num-batched-tokens 256), so a prompt of a few
thousand tokens is prefilled in chunks that share their steps with the running stream's decodes;
and with a body limit large enough for a prompt of megabytes, whose tokenizing (a few seconds on a
CPU) runs on a prepare worker, never on the engine thread.

What the bounds rest on: a stream's gap between two tokens is one engine step. Without chunked
prefill the long prompt's steps would hold the stream for the whole prefill; with it, for one chunk's
step, a small part of that. Step times on a shared CPU vary several-fold, so each bound is a share of
a time measured in the same test, with an absolute floor for fast machines.
"""

import threading
import time

import httpx
import pytest

from tests.server.conftest import SMALL_ENGINE

STEP_TOKENS = 256
LONG_PROMPT_WORDS = 500  # "wordN " is about 4 tokens: some 2,000 tokens, 8 chunks (about 10 s on a CPU today)


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(SMALL_ENGINE + ["--max-num-batched-tokens", str(STEP_TOKENS),
                                        "--max-body-bytes", str(8 << 20)])


class StreamWatch:
    """Streams a long completion on a thread of its own and records when each chunk came."""

    def __init__(self, server):
        self.times: list[float] = []
        self.error: Exception = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(server,), daemon=True)
        self._thread.start()

    def _run(self, server) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.times.append(time.monotonic())
                    if self._stop.is_set():
                        return  # leaving closes the connection, which aborts the request
        except Exception as e:
            self.error = e

    def wait_for_tokens(self, count: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while len(self.times) < count:
            assert self._thread.is_alive() and time.monotonic() < deadline, self.error
            time.sleep(0.05)

    def longest_gap(self, start: float, end: float) -> float:
        """The longest wait for a chunk within [start, end], counting from the last chunk before it."""
        before = [t for t in self.times if t <= start]
        inside = [t for t in self.times if start < t <= end]
        points = before[-1:] + inside + [end]
        return max(b - a for a, b in zip(points, points[1:]))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        assert self.error is None, self.error


def post_during_a_stream(server, body: dict) -> tuple[httpx.Response, float, int, float]:
    """POST a completion while another request streams; returns the response, how long it took, how
    many chunks the stream got meanwhile and the stream's longest wait for one."""
    watch = StreamWatch(server)
    try:
        watch.wait_for_tokens(3)
        start = time.monotonic()
        r = httpx.post(server.base_url + "/completions", json=body, timeout=300)
        end = time.monotonic()
        return r, end - start, len([t for t in watch.times if start < t <= end]), watch.longest_gap(start, end)
    finally:
        watch.close()


def test_a_long_prompt_is_prefilled_in_chunks_between_decodes(server):
    prompt = " ".join(f"word{i}" for i in range(LONG_PROMPT_WORDS))
    r, prefill, during, gap = post_during_a_stream(server, {"prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    assert prompt_tokens > 6 * STEP_TOKENS
    chunks = -(-prompt_tokens // STEP_TOKENS)
    print(f"{prompt_tokens} prompt tokens in {prefill:.1f} s; the stream got {during} tokens meanwhile, "
          f"longest gap {gap:.2f} s")
    assert during >= chunks - 1  # one token per shared step at least
    assert gap < max(3.0, prefill / 2)  # a few chunks' steps at most, never the whole prefill


def test_tokenizing_a_huge_prompt_does_not_stall_the_engine(server):
    """A prompt of megabytes ends in a 400 (past the context length) after seconds of tokenizing; the
    running stream's steps go on meanwhile."""
    huge = "hello world " * 330_000  # 3.96 MB, some 660,000 tokens
    r, took, _, gap = post_during_a_stream(server, {"prompt": huge, "max_tokens": 1})
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"], r.text
    print(f"the 400 took {took:.1f} s; the stream's longest gap meanwhile {gap:.2f} s")
    # on the engine thread, tokenizing would hold the stream for nearly all of the 400's time
    assert gap < max(1.0, took / 2)
