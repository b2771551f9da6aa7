"""Serving benchmark: an async load generator against the OpenAI-compatible HTTP server.

Each request is a streamed `/v1/completions` call with the prompt as token ids, `max_tokens`,
`ignore_eos: true` (a tokenmill extension) and `stream: true`; arrivals follow a Poisson process
at `--request-rate` (or all at once, optionally capped by `--max-concurrency`). For every request
we record the time to the first streamed token (TTFT) and the gaps between later tokens (ITL).
The server sends a chunk per engine step with the new `token_ids` (normally one token); when a
chunk carries k > 1 tokens, the gap since the previous chunk is shared evenly among them and the
request is counted in `multi_token_chunks`. Without `token_ids`, a chunk counts as one token; the
final usage chunk's completion_tokens is checked against the count. Reported: throughput and TTFT / ITL / TPOT / end-to-end percentiles (p50, p90, p99).

`--launch` starts `tokenmill serve MODEL` as a subprocess (engine flags passed through, extra
server flags with `--server-args`; `--speculative-config` and `--synthetic-acceptance` become the
server's `--speculative-config`), waits for `/health`, and stops it at the end; otherwise
`--base-url` points at a running server. `--rates 2,4,8` sweeps request rates against one server;
before each rate we ask the server to forget its prefix cache (`POST /reset_prefix_cache`, if it
has one) and otherwise give each later rate other token ids (same lengths), so no rate benefits
from an earlier one's prompts. Warm-up requests also use other token ids.

With speculation on the server, each rate's `speculative` (and the summary's, of the best rate)
holds the acceptance figures of that rate's requests, from the server's speculative-decoding
counters scraped from `/metrics` before and after the load (acceptance rate, mean accepted length,
acceptance by draft position; see bench/common.py: spec_summary). Each rate also holds the server's
generation-2 garbage-collection pauses during its load (`gc_gen2`: count, mean and the bucket bound
of the largest, from the `tokenmill:gc_pause_seconds` histogram's increase between the scrapes;
`engine_gc_gen2` the same of `tokenmill:engine_gc_pause_seconds` where a server exports it).

`--goodput` finds the highest rate at which ITL p99 <= --goodput-itl-p99-ms and TTFT p99 <=
--goodput-ttft-p99-ms with no failed request (goodput_search: from --goodput-start, double until a
rate fails, then bisect --goodput-rounds times); each probe is a rate run of the first
--goodput-requests requests, recorded in the result's `goodput.probes`, the answer in
`goodput.goodput_req_per_s` (None when even the first rate fails). report.serve_table writes the
rates and probes as a markdown table (also `python -m tokenmill.bench.report serve-table FILE`).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from tokenmill.bench import report
from tokenmill.bench.workloads import BenchRequest, Workload, generate_requests, poisson_arrivals


@dataclass
class RequestRecord:
    prompt_len: int
    max_tokens: int
    ok: bool = False
    error: Optional[str] = None
    send_time: float = 0.0
    token_times: list[float] = field(default_factory=list)
    usage_tokens: Optional[int] = None
    multi_token_chunks: int = 0

    def add_tokens(self, now: float, k: int) -> None:
        """k tokens arrived in one chunk at `now`: the first one ever is TTFT's; otherwise the gap since
        the previous chunk is shared evenly among them (so ITLs stay per token when chunks coalesce)."""
        if k <= 0:
            return
        if not self.token_times:
            self.token_times.append(now)
            k -= 1
            prev = now
        else:
            prev = self.token_times[-1]
        step = (now - prev) / k if k else 0.0
        self.token_times.extend(prev + step * (j + 1) for j in range(k))

    @property
    def output_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else len(self.token_times)


def _percentiles(values, prefix: str, scale: float = 1e3) -> dict:
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64) * scale
    if arr.size == 0:
        return {f"{prefix}_mean": None, f"{prefix}_p50": None, f"{prefix}_p90": None, f"{prefix}_p99": None}
    return {f"{prefix}_mean": float(arr.mean()), f"{prefix}_p50": float(np.percentile(arr, 50)),
            f"{prefix}_p90": float(np.percentile(arr, 90)), f"{prefix}_p99": float(np.percentile(arr, 99))}


def summarize_records(records: list[RequestRecord], duration: float) -> dict:
    ok = [r for r in records if r.ok]
    ttft = [r.token_times[0] - r.send_time for r in ok if r.token_times]
    itl = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:])]
    tpot = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in ok if len(r.token_times) > 1]
    e2e = [r.token_times[-1] - r.send_time for r in ok if r.token_times]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_len for r in ok)
    chunk_mismatch = sum(1 for r in ok if r.usage_tokens is not None and r.usage_tokens != len(r.token_times))
    short = sum(1 for r in ok if r.output_tokens < r.max_tokens)
    multi = sum(r.multi_token_chunks for r in ok)
    s = {"completed": len(ok), "failed": len(records) - len(ok), "duration_s": duration,
         "output_tokens": out_tokens, "prompt_tokens": prompt_tokens,
         "requests_per_s": len(ok) / duration if duration > 0 else None,
         "output_tok_per_s": out_tokens / duration if duration > 0 else None,
         "total_tok_per_s": (out_tokens + prompt_tokens) / duration if duration > 0 else None,
         "requests_with_chunks_not_tokens": chunk_mismatch, "multi_token_chunks": multi, "requests_short_of_max_tokens": short,
         "errors": sorted({r.error for r in records if r.error})[:5]}
    for values, prefix in ((ttft, "ttft_ms"), (itl, "itl_ms"), (tpot, "tpot_ms"), (e2e, "e2e_ms")):
        s.update(_percentiles(values, prefix))
    return s


async def _one_request(session, url: str, model: str, req: BenchRequest, temperature: float,
                       rec: RequestRecord) -> None:
    payload = {"model": model, "prompt": list(req.prompt_token_ids), "max_tokens": req.max_tokens,
               "temperature": temperature, "stream": True, "ignore_eos": True,
               "stream_options": {"include_usage": True}}
    rec.send_time = time.perf_counter()
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            buffer = b""
            done = False
            async for raw in resp.content.iter_any():
                now = time.perf_counter()
                buffer += raw
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        continue
                    chunk = json.loads(data)
                    if chunk.get("error"):
                        rec.error = str(chunk["error"])[:200]
                        return
                    choices = chunk.get("choices")
                    if choices:
                        ids = choices[0].get("token_ids")
                        k = len(ids) if isinstance(ids, list) else 1
                        if k > 1:
                            rec.multi_token_chunks += 1
                        rec.add_tokens(now, k)
                    usage = chunk.get("usage")
                    if usage and usage.get("completion_tokens") is not None:
                        rec.usage_tokens = int(usage["completion_tokens"])
            rec.ok = done or bool(rec.token_times)
            if not rec.ok:
                rec.error = "the stream ended without tokens"
    except Exception as e:  # one failed request must not stop the benchmark
        rec.error = f"{type(e).__name__}: {e}"[:200]


async def run_load(base_url: str, model: str, requests: list[BenchRequest], temperature: float,
                   max_concurrency: Optional[int] = None, timeout_s: float = 3600.0) -> tuple[list[RequestRecord], float]:
    """Send every request at its arrival time; returns the records and the wall time of the run."""
    import aiohttp

    url = base_url.rstrip("/") + "/v1/completions"
    records = [RequestRecord(len(r.prompt_token_ids), r.max_tokens) for r in requests]
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()

        async def launch(i: int, req: BenchRequest) -> None:
            delay = start + req.arrival_time - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if limit is None:
                await _one_request(session, url, model, req, temperature, records[i])
            else:
                async with limit:
                    await _one_request(session, url, model, req, temperature, records[i])

        await asyncio.gather(*(launch(i, r) for i, r in enumerate(requests)))
        duration = time.perf_counter() - start
    return records, duration


# ---- the server ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> Optional[tuple[int, bytes]]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""
    except (urllib.error.URLError, OSError):
        return None


def histograms(metrics_text: str, name: str, by: str) -> dict:
    """{value of label `by`: {"count", "sum", "buckets": {le: cumulative count}}} of the Prometheus
    histogram `name` in a /metrics scrape (text format)."""
    out: dict = {}
    pattern = re.compile(r'^' + re.escape(name) + r'_(bucket|count|sum)\{([^}]*)\}\s+(\S+)$')
    for line in metrics_text.splitlines():
        m = pattern.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        entry = out.setdefault(labels.get(by, "?"), {"count": 0.0, "sum": 0.0, "buckets": {}})
        if m.group(1) == "bucket":
            entry["buckets"][labels["le"]] = float(m.group(3))
        else:
            entry[m.group(1)] = float(m.group(3))
    return out


def counter_total(metrics_text: str, name: str) -> Optional[float]:
    """The sum over label sets of the counter `name` (exported as `name_total`), None if absent."""
    pattern = re.compile(r'^' + re.escape(name) + r'(?:_total)?(?:\{[^}]*\})?\s+(\S+)$')
    values = [float(m.group(1)) for m in map(pattern.match, metrics_text.splitlines()) if m]
    return sum(values) if values else None


def counter_by_label(metrics_text: str, name: str, label: str) -> dict[str, float]:
    """{value of label `label`: value} of the counter `name` (exported as `name_total`)."""
    pattern = re.compile(r'^' + re.escape(name) + r'(?:_total)?\{([^}]*)\}\s+(\S+)$')
    out: dict[str, float] = {}
    for m in map(pattern.match, metrics_text.splitlines()):
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            if label in labels:
                out[labels[label]] = out.get(labels[label], 0.0) + float(m.group(2))
    return out


def spec_counts(metrics_text: str):
    """The server's speculative-decoding counters in a /metrics scrape as SpecDecodeCounts (None: the
    server exports none, i.e. it runs without speculation)."""
    from tokenmill.engine.spec_stats import SpecDecodeCounts

    drafts = counter_total(metrics_text, "tokenmill:spec_decode_num_drafts")
    if drafts is None:
        return None

    def per_position(name: str) -> dict[int, int]:
        return {int(p): int(v) for p, v in counter_by_label(metrics_text, name, "position").items()}

    drafted = per_position("tokenmill:spec_decode_num_draft_tokens_per_pos")
    accepted = per_position("tokenmill:spec_decode_num_accepted_tokens_per_pos")
    k = max([*drafted, *accepted, -1]) + 1
    return SpecDecodeCounts(k, int(drafts),
                            int(counter_total(metrics_text, "tokenmill:spec_decode_num_draft_tokens") or 0),
                            int(counter_total(metrics_text, "tokenmill:spec_decode_num_accepted_tokens") or 0),
                            tuple(drafted.get(i, 0) for i in range(k)), tuple(accepted.get(i, 0) for i in range(k)))


def histogram_summary(before: dict, after: dict) -> dict:
    """The observations between two scrapes of a histogram, per label value: count, mean, and the
    bucket bounds that hold the median and the 99th percentile (a histogram gives no finer answer)."""
    summary = {}
    for kind, a in after.items():
        b = before.get(kind, {"count": 0.0, "sum": 0.0, "buckets": {}})
        count = a["count"] - b["count"]
        if count <= 0:
            continue
        cum = sorted(((float("inf") if le == "+Inf" else float(le), v - b["buckets"].get(le, 0.0))
                      for le, v in a["buckets"].items()))

        def bound(q: float) -> float:
            return next((le for le, c in cum if c >= q * count), float("inf"))

        summary[kind] = {"count": int(count), "mean_ms": 1e3 * (a["sum"] - b["sum"]) / count,
                         "p50_le_ms": 1e3 * bound(0.5), "p99_le_ms": 1e3 * bound(0.99),
                         "max_le_ms": 1e3 * bound(1.0)}
    return summary


GC_HISTOGRAM = "tokenmill:gc_pause_seconds"  # the server (API) process's collections
ENGINE_GC_HISTOGRAM = "tokenmill:engine_gc_pause_seconds"  # an engine process of its own, where exported


def gc_pauses(before: str, after: str, generation: str = "2", name: str = GC_HISTOGRAM) -> Optional[dict]:
    """The server's garbage-collection pauses of one generation between two /metrics scrapes (from the
    histogram `name`): count, mean_ms and max_le_ms (the bucket bound that holds the largest pause);
    count 0 when there was none. None when the server exports no such histogram or a scrape is missing."""
    if not before or not after or not re.search(r"^# TYPE " + re.escape(name) + r" ", after, re.M):
        return None
    seen = histogram_summary(histograms(before, name, "generation"),
                             histograms(after, name, "generation")).get(generation)
    if seen is None:
        return {"count": 0, "mean_ms": None, "max_le_ms": None}
    return {"count": seen["count"], "mean_ms": seen["mean_ms"], "max_le_ms": seen["max_le_ms"]}


def server_side(before: str, after: str) -> dict:
    """What the server saw between two /metrics scrapes: its step intervals by kind, its own ITL
    (before the HTTP stream), garbage-collection pauses by generation, and Triton kernels compiled
    on the step path. Set beside the client's ITL, this tells engine time from delivery time. With
    speculation, `speculative` holds the acceptance figures of the requests between the scrapes
    (bench/common.py: spec_summary); None when the server exports no speculative counters."""
    def hist(name: str, by: str) -> dict:
        return histogram_summary(histograms(before, name, by), histograms(after, name, by))

    def delta(name: str) -> Optional[float]:
        a, b = counter_total(after, name), counter_total(before, name)
        return None if a is None else a - (b or 0.0)

    return {"steps": hist("tokenmill:step_interval_seconds", "kind"),
            "itl": hist("tokenmill:inter_token_latency_seconds", "model_name"),
            "gc_pauses": hist("tokenmill:gc_pause_seconds", "generation"),
            "kernel_compiles": delta("tokenmill:kernel_compiles_after_warmup"),
            "kernel_compile_s": delta("tokenmill:kernel_compile_seconds_after_warmup"),
            "speculative": _spec_delta(before, after)}


def _spec_delta(before: str, after: str) -> Optional[dict]:
    from tokenmill.bench.common import spec_summary

    a = spec_counts(after)
    if a is None:
        return None
    b = spec_counts(before)
    return spec_summary(a.since(b) if b is not None and b.num_speculative_tokens == a.num_speculative_tokens else a)


def _scrape(base_url: str) -> Optional[str]:
    got = _get(base_url.rstrip("/") + "/metrics")
    return got[1].decode() if got and got[0] == 200 else None


def _post(url: str, timeout: float = 10.0) -> Optional[int]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


def wait_healthy(base_url: str, timeout_s: float, proc: Optional[subprocess.Popen] = None) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before becoming healthy")
        got = _get(base_url.rstrip("/") + "/health", timeout=5)
        if got is not None and got[0] == 200:
            return
        time.sleep(1.0)
    raise TimeoutError(f"the server at {base_url} was not healthy after {timeout_s:.0f} s")


def served_model_name(base_url: str, fallback: str) -> str:
    got = _get(base_url.rstrip("/") + "/v1/models")
    if got and got[0] == 200:
        try:
            data = json.loads(got[1]).get("data") or []
            if data and data[0].get("id"):
                return str(data[0]["id"])
        except (ValueError, AttributeError):
            pass
    return fallback


def server_command(args, w: Workload, port: int) -> list[str]:
    from tokenmill.bench.common import engine_namespace
    from tokenmill.entrypoints.cli import engine_flags

    ns = engine_namespace(args, w)
    cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", ns.model, "--host", "127.0.0.1",
           "--port", str(port), "--load-format", ns.load_format, "--dtype", ns.dtype]
    if ns.device is not None:
        cmd += ["--device", ns.device]
    return cmd + engine_flags(ns) + shlex.split(args.server_args or "")


class LaunchedServer:
    def __init__(self, cmd: list[str], base_url: str, log_path: str, health_timeout_s: float):
        self.cmd, self.base_url, self.log_path = cmd, base_url, log_path
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        self._log = open(log_path, "w")
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        try:
            wait_healthy(base_url, health_timeout_s, self.proc)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGINT, 30), (signal.SIGTERM, 15), (signal.SIGKILL, 5)):
                try:
                    os.killpg(self.proc.pid, sig)  # our own process group (start_new_session)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._log.close()

    def tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path) as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""


def server_log_line(server: dict) -> str:
    def hists(title: str, h: dict) -> str:
        return f"{title}: " + ("; ".join(
            f"{k} {v['count']}, mean {v['mean_ms']:.1f} ms, p50 <= {v['p50_le_ms']:.1f}, p99 <= {v['p99_le_ms']:.1f} ms"
            for k, v in sorted(h.items())) or "none")

    compiles = server.get("kernel_compiles")
    return " | ".join([hists("server steps", server["steps"]), hists("server ITL", server["itl"]),
                       hists("GC pauses by generation", server["gc_pauses"]),
                       f"kernels compiled on the step path: {'?' if compiles is None else int(compiles)}"
                       + (f" ({server['kernel_compile_s']:.2f} s)" if compiles else "")])


def _requests_for_rate(w: Workload, rate: Optional[float], index: int, fresh_ids: bool,
                       vocab_size: Optional[int], num_requests: Optional[int] = None) -> list[BenchRequest]:
    """The workload's requests with arrivals at `rate`; with fresh_ids, the same prompt and output
    lengths but other token ids (seed + 1000 x index), so an earlier rate's prefix cache cannot help.
    With num_requests, the first that many (the workload grown to that many if it has fewer)."""
    import random

    n = w.num_requests if num_requests is None else num_requests
    reqs = generate_requests(replace(w, request_rate=None, num_requests=max(n, w.num_requests)), vocab_size)[:n]
    if fresh_ids:
        rng = random.Random(w.seed + 1000 * index)
        top = w.max_token_id if vocab_size is None else min(w.max_token_id, vocab_size - 1)
        reqs = [replace(r, prompt_token_ids=[rng.randint(0, top) for _ in r.prompt_token_ids]) for r in reqs]
    arrivals = poisson_arrivals(len(reqs), rate, w.seed)
    return [replace(r, arrival_time=a) for r, a in zip(reqs, arrivals)]


def _vocab_size(model: str) -> Optional[int]:
    from tokenmill.models.presets import PRESETS

    p = PRESETS.get(model.lower())
    return int(p["vocab_size"]) if p else None


def _device_name(device: Optional[str]) -> str:
    """The GPU the server ran on (asked after the server has stopped, so the client's own CUDA
    context never competes with the server for memory)."""
    if device is not None and str(device).startswith("cpu"):
        from tokenmill.bench.roofline import device_name

        return device_name("cpu")
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:
        pass
    return "unknown (server side)"


@dataclass
class _Target:
    """Where the load goes: the server, the model name it serves, the workload and its vocabulary."""
    base_url: str
    model: str
    w: Workload
    vocab: Optional[int]
    args: object
    log: object


def run_rate(t: _Target, rate: float, index: int, num_requests: Optional[int] = None) -> dict:
    """One rate's load against the server: forget the prefix cache (or, when the server cannot, give
    every load after the first other token ids), scrape /metrics, send the requests at Poisson
    arrivals, scrape again; returns the rate's entry of the result (client summary, server side, GC)."""
    from tokenmill.bench.common import format_spec

    args, log = t.args, t.log
    status = _post(t.base_url.rstrip("/") + "/reset_prefix_cache")
    fresh = index > 0 and status != 200
    reqs = _requests_for_rate(t.w, rate, index, fresh, t.vocab, num_requests)
    log(f"rate {rate} req/s: {len(reqs)} requests"
        + (f", max concurrency {args.max_concurrency}" if args.max_concurrency else ""))
    metrics_before = _scrape(t.base_url)
    records, duration = asyncio.run(run_load(t.base_url, t.model, reqs, t.w.temperature, args.max_concurrency,
                                             args.request_timeout))
    metrics_after = _scrape(t.base_url)
    seen = server_side(metrics_before, metrics_after) if metrics_before and metrics_after else None
    s = summarize_records(records, duration)
    entry = {"request_rate": rate if rate != float("inf") else "inf", "max_concurrency": args.max_concurrency,
             "num_requests": len(reqs), "prefix_cache_reset": status == 200, "fresh_token_ids": fresh,
             "summary": s, "server_steps": seen["steps"] if seen else None, "server_side": seen,
             "gc_gen2": gc_pauses(metrics_before, metrics_after, "2"),
             "engine_gc_gen2": gc_pauses(metrics_before, metrics_after, "2", ENGINE_GC_HISTOGRAM),
             "speculative": seen["speculative"] if seen else None,
             "ttft_ms": [1e3 * (r.token_times[0] - r.send_time) if r.token_times else None
                         for r in records] if args.keep_requests else None}
    log(f"  {s['completed']} ok, {s['failed']} failed in {duration:.1f} s: {s['output_tok_per_s'] or 0:.0f} "
        f"output tok/s, {s['requests_per_s'] or 0:.2f} req/s; TTFT p50/p90/p99 "
        f"{s['ttft_ms_p50'] or 0:.0f}/{s['ttft_ms_p90'] or 0:.0f}/{s['ttft_ms_p99'] or 0:.0f} ms; ITL "
        f"p50/p90/p99 {s['itl_ms_p50'] or 0:.1f}/{s['itl_ms_p90'] or 0:.1f}/{s['itl_ms_p99'] or 0:.1f} ms")
    if seen:
        log("  " + server_log_line(seen))
        if seen["speculative"]:
            log("  " + format_spec(seen["speculative"]))
    if s["errors"]:
        log(f"  errors: {s['errors']}")
    return entry


# ---- goodput: the highest rate that meets the latency targets ------------------------------------


GOODPUT_MAX_FACTOR = 64  # the search's default cap: 64 x the start rate (six doublings)


def goodput_search(passes, start: float, rounds: int = 3, max_rate: Optional[float] = None
                   ) -> tuple[Optional[float], list[tuple[float, bool]]]:
    """The highest request rate for which `passes(rate)` holds, found by a short sweep: `start`, then
    doubling until a rate fails (or `max_rate`, default 64 x start, is reached and passes), then
    `rounds` bisections between the last rate that passed and the first that failed. Returns the
    rate (None when `start` itself fails) and every (rate, passed) probed, in order. Assumes that a
    rate which fails would fail at any higher rate too (the search probes each rate once)."""
    if not (0 < start < float("inf")):
        raise ValueError(f"the goodput search needs a finite start rate > 0, got {start}")
    max_rate = start * GOODPUT_MAX_FACTOR if max_rate is None else max_rate
    probed: list[tuple[float, bool]] = []

    def check(rate: float) -> bool:
        ok = bool(passes(rate))
        probed.append((rate, ok))
        return ok

    if not check(start):
        return None, probed
    lo, hi = start, None
    while lo < max_rate:
        rate = min(2 * lo, max_rate)
        if not check(rate):
            hi = rate
            break
        lo = rate
    if hi is None:
        return lo, probed
    for _ in range(rounds):
        mid = float(f"{(lo + hi) / 2:.3g}")  # readable rates; stop once the interval is that fine
        if not lo < mid < hi:
            break
        if check(mid):
            lo = mid
        else:
            hi = mid
    return lo, probed


def goodput_verdict(summary: dict, itl_p99_ms: float, ttft_p99_ms: float) -> list[str]:
    """Why a probe's client summary misses the targets ([] = it meets them): ITL p99 and TTFT p99 at
    most their thresholds, every request completed."""
    reasons = []
    if summary.get("failed"):
        reasons.append(f"{summary['failed']} requests failed")
    for key, limit, what in (("itl_ms_p99", itl_p99_ms, "ITL p99"), ("ttft_ms_p99", ttft_p99_ms, "TTFT p99")):
        value = summary.get(key)
        if value is None:
            reasons.append(f"no {what} measured")
        elif value > limit:
            reasons.append(f"{what} {value:.1f} ms > {limit:g} ms")
    return reasons


def goodput_of_rates(result: dict, itl_p99_ms: float = 30.0, ttft_p99_ms: float = 1000.0) -> dict:
    """Goodput over a sweep's fixed rates (a result of `bench serve --rates`): each rate's verdict
    (goodput_verdict) and the highest rate that meets the targets with every lower rate meeting
    them too (None when the lowest misses)."""
    rows, best, ok_so_far = [], None, True
    for entry in sorted(result.get("rates") or [], key=lambda e: float(e["request_rate"])):
        s = entry["summary"]
        reasons = goodput_verdict(s, itl_p99_ms, ttft_p99_ms)
        ok_so_far = ok_so_far and not reasons
        if ok_so_far:
            best = float(entry["request_rate"])
        steps = entry.get("server_steps") or {}
        rows.append({"request_rate": float(entry["request_rate"]), "num_requests": entry.get("num_requests"),
                     "output_tok_per_s": s.get("output_tok_per_s"), "ttft_ms_p50": s.get("ttft_ms_p50"),
                     "ttft_ms_p99": s.get("ttft_ms_p99"), "itl_ms_p50": s.get("itl_ms_p50"),
                     "itl_ms_p99": s.get("itl_ms_p99"), "failed": s.get("failed"),
                     "mixed_steps": steps.get("mixed"), "passed": not reasons, "fail_reasons": reasons})
    return {"goodput_req_per_s": best, "itl_p99_ms_max": itl_p99_ms, "ttft_p99_ms_max": ttft_p99_ms, "rates": rows}


def goodput_start(args, w: Workload) -> float:
    """--goodput's first rate: --goodput-start, else the workload's rate (SystemExit when neither is a
    finite rate > 0, or the other goodput flags are out of range)."""
    start = args.goodput_start if args.goodput_start is not None else w.request_rate
    if start is None or not 0 < start < float("inf"):
        raise SystemExit(f"--goodput needs a finite start rate > 0: give --goodput-start (the workload's rate is "
                         f"{w.request_rate})")
    if args.goodput_requests < 1 or args.goodput_rounds < 0:
        raise SystemExit("--goodput-requests must be >= 1 and --goodput-rounds >= 0")
    if args.goodput_max_rate is not None and args.goodput_max_rate < start:
        raise SystemExit(f"--goodput-max-rate {args.goodput_max_rate:g} is below the start rate {start:g}")
    return float(start)


def run_goodput(t: _Target, first_index: int) -> dict:
    """`--goodput`: goodput_search over run_rate probes of --goodput-requests requests each."""
    args, log = t.args, t.log
    start = goodput_start(args, t.w)
    itl_max, ttft_max = args.goodput_itl_p99_ms, args.goodput_ttft_p99_ms
    log(f"goodput search: ITL p99 <= {itl_max:g} ms and TTFT p99 <= {ttft_max:g} ms, from {start:g} req/s, "
        f"{args.goodput_requests} requests a probe, {args.goodput_rounds} bisection rounds")
    probes: list[dict] = []

    def passes(rate: float) -> bool:
        entry = run_rate(t, rate, first_index + len(probes), args.goodput_requests)
        s = entry["summary"]
        reasons = goodput_verdict(s, itl_max, ttft_max)
        entry.update({"itl_ms_p99": s["itl_ms_p99"], "ttft_ms_p99": s["ttft_ms_p99"],
                      "output_tok_per_s": s["output_tok_per_s"], "passed": not reasons, "fail_reasons": reasons})
        probes.append(entry)
        log(f"  goodput probe {rate:g} req/s: " + ("pass" if not reasons else "FAIL (" + "; ".join(reasons) + ")"))
        return not reasons

    best, _ = goodput_search(passes, start, args.goodput_rounds, args.goodput_max_rate)
    max_rate = args.goodput_max_rate if args.goodput_max_rate is not None else GOODPUT_MAX_FACTOR * start
    if best is None:
        note = (f"even the first rate, {start:g} req/s, misses the targets ({'; '.join(probes[0]['fail_reasons'])}): "
                "no goodput; try a lower --goodput-start")
    elif best >= max_rate:
        note = f"every rate passed up to the search's cap, {max_rate:g} req/s (--goodput-max-rate): a lower bound"
    else:
        note = None
    log(f"goodput: {'none' if best is None else f'{best:g} req/s'}" + (f" ({note})" if note else ""))
    return {"goodput_req_per_s": best, "note": note, "itl_p99_ms_max": itl_max, "ttft_p99_ms_max": ttft_max,
            "start_rate": start, "max_rate": max_rate, "rounds": args.goodput_rounds,
            "requests_per_probe": args.goodput_requests, "probes": probes}


def run(args, log=None) -> dict:
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    from tokenmill.bench.common import resolve_workload, speculative_config

    w = resolve_workload(args, "serve-8b")
    if args.base_url and not args.launch and speculative_config(args) is not None:
        log("note: --speculative-config / --synthetic-acceptance configure a server that --launch starts; the "
            "server at --base-url runs with its own configuration")
    goodput_on = bool(getattr(args, "goodput", False))
    if args.rates:
        rates = [float(x) for x in args.rates.split(",") if x.strip()]
    elif goodput_on:
        rates = []  # only the goodput search
    else:
        rates = [args.request_rate if args.request_rate is not None else (w.request_rate or float("inf"))]
    if goodput_on:
        goodput_start(args, w)  # refuse bad goodput flags before a server is started
    server = None
    base_url = args.base_url
    if args.launch:
        port = args.port or free_port()
        base_url = f"http://127.0.0.1:{port}"
        cmd = server_command(args, w, port)
        log_path = os.path.join(args.out, report.result_stem("server", w.name, args.tag) + ".log")
        log(f"launching: {' '.join(shlex.quote(c) for c in cmd)} (log: {log_path})")
        t0 = time.perf_counter()
        server = LaunchedServer(cmd, base_url, log_path, args.server_timeout)
        log(f"server healthy after {time.perf_counter() - t0:.1f} s")
    elif not base_url:
        raise SystemExit("bench serve needs --launch or --base-url")
    goodput = None
    try:
        target = _Target(base_url, served_model_name(base_url, w.model), w, _vocab_size(w.model), args, log)
        if args.warmup_requests > 0:
            warm = _requests_for_rate(w, None, 99, True, target.vocab)[: args.warmup_requests]
            warm = [replace(r, max_tokens=min(r.max_tokens, 16)) for r in warm]
            records, _ = asyncio.run(run_load(base_url, target.model, warm, w.temperature))
            bad = [r.error for r in records if not r.ok]
            if bad:
                raise RuntimeError(f"warm-up requests failed: {bad[0]}")
        per_rate = [run_rate(target, rate, i) for i, rate in enumerate(rates)]
        if goodput_on:
            goodput = run_goodput(target, len(per_rate))
    except BaseException:
        if server is not None:
            log("server log tail:\n" + server.tail())
        raise
    finally:
        if server is not None:
            server.stop()
    result = report.metadata("serve")
    result.update({"tag": args.tag, "workload": w.to_dict(), "model": w.model, "dtype": w.dtype,
                   "device": None, "device_name": _device_name(args.device), "base_url": base_url,
                   "launched": bool(args.launch), "server_command": server.cmd if server else None,
                   "ceilings": None, "roofline": None, "rates": per_rate,
                   "results": {"rates": per_rate}, "goodput": goodput})
    runs = per_rate or (goodput["probes"] if goodput else [])
    best = max(runs, key=lambda r: r["summary"]["output_tok_per_s"] or 0)
    result["summary"] = {"output_tok_per_s": best["summary"]["output_tok_per_s"], "rates": rates,
                         "speculative": best["speculative"],
                         "goodput_req_per_s": goodput["goodput_req_per_s"] if goodput else None}
    return result


def print_summary(result: dict, out=None) -> None:
    out = out or sys.stdout  # looked up per call (a test may have replaced it)
    from tokenmill.bench.report import format_table, serve_table, summary_rows

    print(format_table(summary_rows({"results": [result]})), file=out)
    print("", file=out)
    print(serve_table(result), file=out)
