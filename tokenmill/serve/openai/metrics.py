"""Prometheus metrics, in a registry of the app's own (so several apps never share state).

Names follow vLLM's conventions with a `tokenmill:` prefix. Engine state (running/waiting requests,
KV-cache usage, prefix-cache hit rate, preemptions) is read at scrape time from the snapshot the
engine thread publishes; latencies and token counts are observed by the engine thread as outputs
come out (prometheus_client is thread-safe).

Speculative decoding (only when the server runs with a speculative config; a server without one
exports none of these, as a feature that is off has nothing to count). Read from the same snapshot,
a frozen copy of the engine's `SpecDecodeStats` (tokenmill/engine/spec_stats.py):

- counters `tokenmill:spec_decode_num_drafts` (request-steps that verified a draft),
  `tokenmill:spec_decode_num_draft_tokens`, `tokenmill:spec_decode_num_accepted_tokens`, and per
  draft position (label `position`, 0-based) `tokenmill:spec_decode_num_draft_tokens_per_pos`
  (drafts that reached that position) and `tokenmill:spec_decode_num_accepted_tokens_per_pos`
  (drafts accepted up to and including it);
- gauges over the server's lifetime (0 until the first draft is verified): `tokenmill:spec_decode_acceptance_rate` (accepted / draft
  tokens) and `tokenmill:spec_decode_mean_accepted_length` (tokens a verifying request-step emits,
  1 + accepted tokens / num_drafts). For a window, take the counters' increases instead, e.g.
  `rate(..._num_accepted_tokens_total[5m]) / rate(..._num_draft_tokens_total[5m])`.

Host-memory KV tier (only with `--kv-offloading-size`): counters `tokenmill:kv_offload_hit_tokens`
(prompt tokens loaded from host memory instead of computed), `_lookup_tokens` (prompt tokens looked
up there, past each GPU hit), `_bytes_saved` (device to host), `_bytes_loaded` (host to device),
`_load_seconds` (time the loads took), `_failed_loads` (loads that failed and were recomputed); gauge
`tokenmill:kv_offload_num_blocks` (host blocks in all). Totals only, never per request; and like the
prefix-cache series they move with single requests (a host hit tells a prefix was sent before), so
they are in PREFIX_CACHE_SERIES.

Prefill/decode transfers (only with the SharedStorageConnector, kv_connector/shared_storage.py):
counters `tokenmill:kv_transfer_loaded_tokens` (prompt tokens a decode engine loaded from its
prefill peer instead of computing them), `_lookup_tokens`, `_blocks_saved` / `_bytes_saved` (what a
prefill engine wrote for its peer), `_blocks_loaded` / `_bytes_loaded`, `_load_seconds` and
`_failed_loads` (loads that failed and were recomputed). Also in PREFIX_CACHE_SERIES.

Data parallelism (`--data-parallel-size N`, serve/dp_client.py): the series above are the totals
over the replicas; `tokenmill:data_parallel_size` and, with a `replica` label ("0".."N-1"), each
replica's own `tokenmill:replica_num_requests_running`, `_num_requests_waiting`,
`_kv_cache_usage_perc`, `_num_kv_blocks_free`, `_num_kv_blocks`, `_prefix_cache_hit_rate` (gauges)
and `_num_preemptions`, `_engine_steps`, `_prompt_tokens_computed`, `_generation_tokens`,
`_requests_routed`, `_requests_routed_by_prefix` (counters: the balancer's choices, the latter those
made for a cached prompt prefix).

Prefix-cache figures (PREFIX_CACHE_SERIES) move with single requests: whoever reads them can tell
whether a prompt prefix they guess was sent before. With several tenants they are left out unless
the caller may see them (serve/openai/tenants.py decides; render's `prefix_cache` flag).
"""

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tokenmill.serve.async_engine import AsyncLLMEngine, EngineObserver
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.spec_stats import SpecDecodeCounts
from tokenmill.kv_connector.counts import HostTierCounts, SharedStorageCounts

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)


# Data parallelism: per-replica series (label `replica`), from DPEngineClient.replica_stats().
_REPLICA_GAUGES = (
    ("tokenmill:replica_num_requests_running", "Requests (samples) in this replica's running batch.",
     lambda r: r.snapshot.num_running),
    ("tokenmill:replica_num_requests_waiting", "Requests (samples) waiting in this replica.",
     lambda r: r.snapshot.num_waiting),
    ("tokenmill:replica_kv_cache_usage_perc", "Fraction of this replica's KV-cache blocks held by requests.",
     lambda r: r.snapshot.kv_cache_usage),
    ("tokenmill:replica_num_kv_blocks_free", "This replica's free KV-cache blocks.",
     lambda r: r.snapshot.num_free_blocks),
    ("tokenmill:replica_num_kv_blocks", "This replica's KV-cache blocks.", lambda r: r.snapshot.num_blocks),
    ("tokenmill:replica_prefix_cache_hit_rate", "This replica's prompt tokens found in its prefix cache / looked up.",
     lambda r: r.snapshot.prefix_cache_hit_rate),
)
_REPLICA_COUNTERS = (
    ("tokenmill:replica_num_preemptions", "Requests this replica preempted.", lambda r: r.snapshot.num_preemptions),
    ("tokenmill:replica_engine_steps", "Engine steps this replica ran.", lambda r: r.steps),
    ("tokenmill:replica_prompt_tokens_computed", "Prompt tokens this replica computed (prefix-cache hits not "
     "counted).", lambda r: r.snapshot.prompt_tokens),
    ("tokenmill:replica_generation_tokens", "Tokens this replica generated.", lambda r: r.snapshot.generation_tokens),
    ("tokenmill:replica_requests_routed", "Requests the balancer sent to this replica.", lambda r: r.routed),
    ("tokenmill:replica_requests_routed_by_prefix", "Of those, requests sent there for its cached prompt prefix.",
     lambda r: r.routed_by_prefix),
)


# The host tier's counters (HostTierCounts field, help).
_KV_OFFLOAD_COUNTERS = (
    ("hit_tokens", "Prompt tokens loaded from the host-memory KV tier instead of computed."),
    ("lookup_tokens", "Prompt tokens looked up in the host-memory KV tier (past each GPU prefix-cache hit)."),
    ("bytes_saved", "Bytes of KV blocks copied from the device to the host tier."),
    ("bytes_loaded", "Bytes of KV blocks copied from the host tier to the device."),
    ("load_seconds", "Seconds the host-tier loads took (issue to completion on the device)."),
    ("failed_loads", "Host-tier loads that failed (their prefix was recomputed)."),
)
KV_OFFLOAD_SERIES = frozenset(["tokenmill:kv_offload_" + name for name, _ in _KV_OFFLOAD_COUNTERS]
                              + ["tokenmill:kv_offload_num_blocks"])
_KV_TRANSFER_COUNTERS = (
    ("loaded_tokens", "Prompt tokens loaded from the prefill peer's KV blocks instead of computed."),
    ("lookup_tokens", "Prompt tokens looked up among the peer's KV blocks (past each GPU prefix-cache hit)."),
    ("blocks_saved", "KV blocks written for the decode peer."),
    ("bytes_saved", "Bytes of KV blocks written for the decode peer."),
    ("blocks_loaded", "KV blocks loaded from the prefill peer."),
    ("bytes_loaded", "Bytes of KV blocks loaded from the prefill peer."),
    ("load_seconds", "Seconds the loads from the prefill peer took (issue to completion)."),
    ("failed_loads", "Loads from the prefill peer that failed (their prefix was recomputed)."),
)
KV_TRANSFER_SERIES = frozenset("tokenmill:kv_transfer_" + name for name, _ in _KV_TRANSFER_COUNTERS)

# Series that tell a prompt prefix was cached (the computed-token count drops on a hit).
PREFIX_CACHE_SERIES = frozenset({"tokenmill:prefix_cache_hit_rate", "tokenmill:replica_prefix_cache_hit_rate",
                                 "tokenmill:replica_requests_routed_by_prefix",
                                 "tokenmill:replica_prompt_tokens_computed"}) | KV_OFFLOAD_SERIES | KV_TRANSFER_SERIES


class _Without:
    """A registry's collection less some metric families (generate_latest reads any `collect()`)."""

    def __init__(self, registry: CollectorRegistry, names: frozenset):
        self.registry = registry
        self.names = names

    def collect(self):
        return (family for family in self.registry.collect() if family.name not in self.names)


class _EngineStateCollector:
    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def describe(self):
        return []  # dynamic: don't let the registry call collect() at registration

    def collect(self):
        s = self.engine.stats
        labels = ["model_name"]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([self.model_name], value)
            return g

        yield gauge("tokenmill:num_requests_running", "Requests (samples) in the running batch.", s.num_running)
        yield gauge("tokenmill:num_requests_waiting", "Requests (samples) waiting to be scheduled.", s.num_waiting)
        yield gauge("tokenmill:kv_cache_usage_perc", "Fraction of KV-cache blocks held by requests (0..1).",
                    s.kv_cache_usage)
        yield gauge("tokenmill:num_kv_blocks_free", "Free KV-cache blocks (cached-but-unused count as free).",
                    s.num_free_blocks)
        yield gauge("tokenmill:num_kv_blocks", "KV-cache blocks in all.", s.num_blocks)
        yield gauge("tokenmill:prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / looked up.",
                    s.prefix_cache_hit_rate)
        yield gauge("tokenmill:num_active_requests", "HTTP-level requests not yet finished.", s.num_active_groups)
        c = CounterMetricFamily("tokenmill:num_preemptions", "Requests preempted (recomputed later).", labels=labels)
        c.add_metric([self.model_name], s.num_preemptions)
        yield c
        c = CounterMetricFamily("tokenmill:engine_steps", "Engine steps run.", labels=labels)
        c.add_metric([self.model_name], s.num_steps)
        yield c
        c = CounterMetricFamily("tokenmill:kernel_compiles_after_warmup",
                                "Triton kernels compiled on the step path after warm-up.", labels=labels)
        c.add_metric([self.model_name], s.kernel_compiles_after_warmup)
        yield c
        c = CounterMetricFamily("tokenmill:kernel_compile_seconds_after_warmup",
                                "Seconds spent compiling Triton kernels on the step path.", labels=labels)
        c.add_metric([self.model_name], s.kernel_compile_seconds_after_warmup)
        yield c
        if s.spec_decode is not None:
            yield from self._spec_decode(s.spec_decode)
        if s.kv_offload is not None:
            yield from self._kv_offload(s.kv_offload)
        if s.kv_transfer is not None:
            yield from self._kv_transfer(s.kv_transfer)
        restarts = getattr(self.engine.engine, "engine_restarts", None)  # an engine in a process of its own
        if restarts is not None:
            c = CounterMetricFamily("tokenmill:engine_restarts", "Engine processes restarted after one died.",
                                    labels=labels)
            c.add_metric([self.model_name], restarts)
            yield c
        replica_stats = getattr(self.engine.engine, "replica_stats", None)
        if callable(replica_stats):
            yield from self._replicas(replica_stats())

    def _replicas(self, replicas):
        """Data parallelism (serve/dp_client.py): each replica's own counters, label `replica`; the
        unlabeled series above are their totals."""
        labels = ["model_name", "replica"]

        def family(kind, name, doc, value_of):
            f = kind(name, doc, labels=labels)
            for r in replicas:
                f.add_metric([self.model_name, str(r.index)], value_of(r))
            return f

        g = GaugeMetricFamily("tokenmill:data_parallel_size", "Engine replicas (data parallelism).",
                              labels=["model_name"])
        g.add_metric([self.model_name], len(replicas))
        yield g
        for name, doc, value_of in _REPLICA_GAUGES:
            yield family(GaugeMetricFamily, name, doc, value_of)
        for name, doc, value_of in _REPLICA_COUNTERS:
            yield family(CounterMetricFamily, name, doc, value_of)

    def _kv_offload(self, host: HostTierCounts):
        labels = ["model_name"]
        for name, doc in _KV_OFFLOAD_COUNTERS:
            c = CounterMetricFamily("tokenmill:kv_offload_" + name, doc, labels=labels)
            c.add_metric([self.model_name], getattr(host, name))
            yield c
        g = GaugeMetricFamily("tokenmill:kv_offload_num_blocks", "Blocks the host-memory KV tier holds in all.",
                              labels=labels)
        g.add_metric([self.model_name], host.num_slots)
        yield g

    def _kv_transfer(self, moved: SharedStorageCounts):
        for name, doc in _KV_TRANSFER_COUNTERS:
            c = CounterMetricFamily("tokenmill:kv_transfer_" + name, doc, labels=["model_name"])
            c.add_metric([self.model_name], getattr(moved, name))
            yield c

    def _spec_decode(self, spec: SpecDecodeCounts):
        labels = ["model_name"]

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric([self.model_name], value)
            return c

        def per_position(name, doc, values):
            c = CounterMetricFamily(name, doc, labels=labels + ["position"])
            for position, value in enumerate(values):
                c.add_metric([self.model_name, str(position)], value)
            return c

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([self.model_name], value)
            return g

        yield counter("tokenmill:spec_decode_num_drafts",
                      "Speculative decoding: request-steps that verified draft tokens.", spec.verify_steps)
        yield counter("tokenmill:spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified.",
                      spec.drafts)
        yield counter("tokenmill:spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.",
                      spec.accepted)
        yield per_position("tokenmill:spec_decode_num_draft_tokens_per_pos",
                           "Speculative decoding: drafts that had a token at this position (0-based).",
                           spec.drafted_at)
        yield per_position("tokenmill:spec_decode_num_accepted_tokens_per_pos",
                           "Speculative decoding: drafts accepted up to and including this position (0-based).",
                           spec.accepted_at)
        yield gauge("tokenmill:spec_decode_acceptance_rate",
                    "Speculative decoding: accepted / verified draft tokens, since the server started.",
                    spec.acceptance_rate)
        yield gauge("tokenmill:spec_decode_mean_accepted_length",
                    "Speculative decoding: tokens a verifying request-step emitted on average "
                    "(1 + accepted drafts), since the server started.", spec.mean_accepted_length)


class ServerMetrics:
    """Also the AsyncLLMEngine's observer: implements EngineObserver (first_token, inter_token,
    step_interval, finished), called on the engine thread."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        r, lbl = self.registry, ["model_name"]
        self.ttft = Histogram("tokenmill:time_to_first_token_seconds", "Time from arrival to the first token.",
                              lbl, buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("tokenmill:inter_token_latency_seconds", "Time between successive tokens of a sample.",
                             lbl, buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("tokenmill:e2e_request_latency_seconds", "Time from arrival to the end of a request.",
                             lbl, buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        self._steps = Histogram("tokenmill:step_interval_seconds",
                                "Time between engine steps while busy, by the kind of step that completed.",
                                lbl + ["kind"], buckets=_ITL_BUCKETS, registry=r)
        self._gc = Histogram("tokenmill:gc_pause_seconds",
                             "Python garbage-collection pauses, by generation (a pause stops every thread).",
                             lbl + ["generation"], buckets=_ITL_BUCKETS, registry=r)
        self._gc_start: float = 0.0
        self._engine_gc = Histogram("tokenmill:engine_gc_pause_seconds",
                                    "Garbage-collection pauses in the engine process, by generation (a pause "
                                    "stops its steps).", lbl + ["generation"], buckets=_ITL_BUCKETS, registry=r)
        self.prompt_tokens = Counter("tokenmill:prompt_tokens", "Prompt tokens of finished requests.", lbl,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("tokenmill:generation_tokens", "Tokens generated.", lbl,
                                         registry=r).labels(model_name)
        self._success = Counter("tokenmill:request_success", "Finished samples by finish reason.",
                                lbl + ["finished_reason"], registry=r)
        self._rejected = Counter("tokenmill:request_rejected", "Requests refused before running, by reason.",
                                 lbl + ["reason"], registry=r)
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)
        for reason in ("invalid", "overloaded", "unavailable"):
            self._rejected.labels(model_name, reason)

    def attach(self, engine: AsyncLLMEngine) -> None:
        self.registry.register(_EngineStateCollector(engine, self.model_name))
        observer: EngineObserver = self
        engine.observer = observer

    # ---- the engine thread's observer interface ----------------------------------------------
    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def step_interval(self, kind: str, seconds: float) -> None:
        self._steps.labels(self.model_name, kind).observe(seconds)

    def finished(self, output: RequestOutput, seconds: float) -> None:
        self.e2e.observe(seconds)
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        for c in output.outputs:
            self.generation_tokens.inc(len(c.token_ids))
            self._success.labels(self.model_name, c.finish_reason or "abort").inc()

    def engine_gc_pause(self, generation: int, seconds: float) -> None:
        self._engine_gc.labels(self.model_name, str(generation)).observe(seconds)

    def gc_callback(self, phase: str, info: dict) -> None:
        """For gc.callbacks (the app's lifespan adds and removes it): times each collection."""
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self._gc.labels(self.model_name, str(info.get("generation", "?"))).observe(
                time.perf_counter() - self._gc_start)

    # ---- handlers ---------------------------------------------------------------------------
    def rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def render(self, prefix_cache: bool = True) -> bytes:
        """The Prometheus text; without the prefix-cache series unless `prefix_cache`."""
        return generate_latest(self.registry if prefix_cache else _Without(self.registry, PREFIX_CACHE_SERIES))
