"""A short request's time to first token beside a long prompt's prefill, through the real server on
the CPU with the embedded model.

    python benchmarks/cpu_ttft_beside_prefill.py [--prompt-tokens 8000] [--server-args "..."] [--out FILE]

Starts `tokenmill serve` (embedded model, CPU, float32), then:
1. alone: --alone short requests one after another (streamed, prompt of --short-tokens token ids);
   their TTFT median;
2. beside: a streamed request with a prompt of --prompt-tokens token ids (max_tokens 1), and while
   its prefill runs, short requests one after another (the first --first-after seconds after it,
   then each --gap seconds after the previous one ended); their TTFT median and max.
The ratios beside / alone are what the serving path promises to keep small (a new request is
scheduled at the step after it arrives). Every prompt is distinct token ids, so the prefix cache
plays no part. The JSON includes the load average before and after (the machine is shared).
"""

import argparse
import logging
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from _report import emit

logger = logging.getLogger("cpu_ttft_beside_prefill")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(extra: list[str], timeout: float = 600.0) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    log = tempfile.NamedTemporaryFile("w", prefix="tokenmill-ttft-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--device", "cpu", "--dtype", "float32",
           "--port", str(port), *extra]
    env = dict(os.environ, PYTHONPATH=ROOT + (os.pathsep + os.environ["PYTHONPATH"]
                                              if os.environ.get("PYTHONPATH") else ""))
    logger.info("starting %s (log %s)", " ".join(shlex.quote(c) for c in cmd), log.name)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; see {log.name}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log.name
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"the server was not ready in {timeout:.0f} s; see {log.name}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def ttft(url: str, prompt: list[int], max_tokens: int) -> float:
    """Seconds from sending a streamed completion to its first token."""
    body = {"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}
    start = time.monotonic()
    first = None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                first = time.monotonic() - start
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return first


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=8000)
    ap.add_argument("--short-tokens", type=int, default=16)
    ap.add_argument("--alone", type=int, default=5, help="short requests timed alone")
    ap.add_argument("--first-after", type=float, default=1.0, help="seconds after the long request")
    ap.add_argument("--gap", type=float, default=0.5, help="seconds between short requests beside it")
    ap.add_argument("--server-args", default="", help="extra flags for tokenmill serve (one string)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    load_before = load_average()
    proc, url, log_path = start_server(shlex.split(args.server_args))
    try:
        ttft(url, ids(args.short_tokens), 2)  # untimed: the first request's one-off costs
        alone = [ttft(url, ids(args.short_tokens), 2) for _ in range(args.alone)]
        logger.info("alone: %s s", [round(t, 3) for t in alone])
        long_result: dict = {}

        def run_long() -> None:
            try:
                long_result["ttft_s"] = ttft(url, ids(args.prompt_tokens), 1)
            except Exception as e:  # reported below
                long_result["error"] = repr(e)

        thread = threading.Thread(target=run_long, daemon=True)
        started = time.monotonic()
        thread.start()
        time.sleep(args.first_after)
        beside = []
        while thread.is_alive():
            sent = time.monotonic() - started
            t = ttft(url, ids(args.short_tokens), 2)  # sent while the long prompt's prefill runs
            beside.append({"sent_after_s": round(sent, 2), "ttft_s": round(t, 3)})
            logger.info("beside, sent %.1f s into the prefill: %.3f s", sent, t)
            time.sleep(args.gap)
        thread.join()
        if "error" in long_result:
            raise RuntimeError(f"the long request failed: {long_result['error']}")
    finally:
        stop_server(proc)
    alone_med = statistics.median(alone)
    beside_t = [b["ttft_s"] for b in beside]
    result = {
        "prompt_tokens": args.prompt_tokens, "short_tokens": args.short_tokens, "server_args": args.server_args,
        "ttft_alone_s": [round(t, 3) for t in alone], "ttft_alone_median_s": round(alone_med, 3),
        "beside": beside, "long_prompt_ttft_s": round(long_result["ttft_s"], 2),
        "ttft_beside_median_s": round(statistics.median(beside_t), 3) if beside_t else None,
        "ttft_beside_max_s": max(beside_t) if beside_t else None,
        "ratio_median": round(statistics.median(beside_t) / alone_med, 2) if beside_t else None,
        "ratio_max": round(max(beside_t) / alone_med, 2) if beside_t else None,
        "load_average_before": load_before, "load_average_after": load_average(), "cpus": os.cpu_count(),
        "server_log": log_path,
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
