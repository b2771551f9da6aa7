"""Data parallelism (`tokenmill serve --data-parallel-size 2`, serve/dp_client.py).

The balancing policy and the other pure parts are tested without processes; then one real server
with two replicas of the embedded model (fp32 on the CPU) for the module, driven by the `openai`
client: a burst of concurrent completions all finish with the single engine's greedy tokens and
reach both replicas (per-replica /metrics); the same long prompt keeps going to one replica (prefix
affinity); killing one replica's process ends the streams with an error naming it and the server
exits with status 1 (a replica is not restarted). The last test kills a replica, so it must stay last.
"""

import asyncio
import os
import pickle
import re
import signal
import threading
import time

import httpx
import pytest

from tests.server.conftest import SMALL_ENGINE, ServerProcess
from tokenmill.config import ConfigError
from tokenmill.serve.dp_client import (BalancerConfig, Placement, ReplicaBalancer, ReplicaLaunch, cpu_threads,
                                        replica_devices, total_snapshot)
from tokenmill.engine.engine_snapshot import EngineSnapshot
from tokenmill.kv_connector.counts import HostTierCounts
from tokenmill.engine.spec_stats import SpecDecodeCounts

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"
BURST = ["The capital of France is", "One, two, three,", "The sky is", "My favourite food is",
         "Water boils at", "The opposite of hot is", "A week has", "Cats and", "Once upon a time",
         "The sun rises in the"]
MAX_TOKENS = 8
# Long enough for the whole affinity key (4 blocks of 16 tokens) and more.
LONG = ("You are a careful assistant. Answer briefly and precisely, using plain words, and never make "
        "up facts you do not know. The user asks about geography, cooking and the history of science; "
        "keep each answer under three sentences. Question: what is the capital of Italy? Answer:")


# ---- the balancing policy ------------------------------------------------------------------
def _balancer(n=2, **kw) -> ReplicaBalancer:
    return ReplicaBalancer(BalancerConfig(n, 4, **kw))


def _send(b: ReplicaBalancer, loads, keys) -> Placement:
    p = b.choose(loads, keys)
    b.record(p, keys)
    return p


def test_prefix_keys_cover_full_blocks_only_and_depend_on_the_adapter_and_salt():
    b = _balancer(affinity_blocks=3)
    assert b.prefix_keys([1, 2, 3]) == []  # no full block
    keys = b.prefix_keys(list(range(10)))
    assert len(keys) == 2 and len(set(keys)) == 2
    assert b.prefix_keys(list(range(10)) + [99, 98])[:2] == keys  # a chain: a longer prompt extends it
    assert len(b.prefix_keys(list(range(100)))) == 3  # at most affinity_blocks
    assert b.prefix_keys(list(range(8)))[:1] == b.prefix_keys([0, 1, 2, 3, 7, 7, 7, 7])[:1]
    assert b.prefix_keys(list(range(8)), lora_id=1) != b.prefix_keys(list(range(8)))
    salted = b.prefix_keys(list(range(8)), cache_salt="tenant-a")
    assert salted != b.prefix_keys(list(range(8))) and salted != b.prefix_keys(list(range(8)), cache_salt="tenant-b")


def test_least_loaded_wins_and_ties_alternate():
    b = _balancer(3)
    assert _send(b, [5, 1, 3], []) == Placement(1, False)
    seen = [_send(b, [0, 0, 0], []).replica for _ in range(6)]
    assert sorted(seen[:3]) == [0, 1, 2] and seen[:3] == seen[3:]  # an idle server goes round
    assert _send(b, [2, 2, 1], []) == Placement(2, False)


def test_affinity_within_the_margin_and_the_least_loaded_beyond_it():
    b = _balancer(2, abs_margin=2, rel_margin=0.1)
    keys = b.prefix_keys(list(range(16)))
    assert _send(b, [0, 0], keys).replica == 0
    assert _send(b, [1, 0], keys) == Placement(0, True)
    assert _send(b, [2, 0], keys) == Placement(0, True)  # min + 2
    assert _send(b, [3, 0], keys) == Placement(1, False)  # beyond: the least loaded, which now has it
    assert _send(b, [3, 2], keys) == Placement(1, True)
    # With a larger load the relative margin counts: 10% of 50 = 5.
    assert _send(b, [50, 55], keys) == Placement(1, True)
    assert _send(b, [50, 56], keys) == Placement(0, False)
    assert b.margin(0) == 2 and b.margin(50) == 5


def test_the_longest_remembered_prefix_decides():
    b = _balancer(2)
    shared = list(range(4))
    first = shared + [10, 11, 12, 13]
    second = shared + [20, 21, 22, 23]
    assert _send(b, [0, 0], b.prefix_keys(first)).replica == 0
    assert _send(b, [5, 0], b.prefix_keys(second)).replica == 1  # replica 0 busy: the shared block moves
    # first's two-block key still points at 0; second's at 1; a third prompt on the shared block: 1.
    assert b.choose([0, 0], b.prefix_keys(first)) == Placement(0, True)
    assert b.choose([0, 0], b.prefix_keys(second)) == Placement(1, True)
    assert b.choose([0, 0], b.prefix_keys(shared + [30, 31, 32, 33])) == Placement(1, True)


def test_the_map_is_bounded_and_forgets_a_reset_replica():
    b = _balancer(2, capacity=3, affinity_blocks=1)
    for t in range(5):
        _send(b, [0, 0], b.prefix_keys([t] * 4))
    assert len(b) == 3
    assert not b.choose([0, 0], b.prefix_keys([0] * 4)).by_prefix  # the oldest went first
    assert b.choose([0, 0], b.prefix_keys([4] * 4)).by_prefix
    owner = b.choose([0, 0], b.prefix_keys([4] * 4)).replica
    b.forget(owner)
    assert not b.choose([0, 0], b.prefix_keys([4] * 4)).by_prefix
    b.forget()
    assert len(b) == 0
    with pytest.raises(ValueError):
        b.choose([0, 0, 0], [])


def test_totals_of_the_replicas_snapshots():
    a = EngineSnapshot(num_running=2, num_waiting=1, kv_cache_usage=0.5, num_free_blocks=50, num_blocks=100,
                       prefix_cache_hit_rate=0.5, num_preemptions=1, prompt_tokens=100, generation_tokens=7,
                       spec_decode=SpecDecodeCounts(2, 3, 6, 4, (3, 3), (3, 1)),
                       kv_offload=HostTierCounts(hit_tokens=32, bytes_loaded=4096, load_seconds=0.5, num_slots=10))
    b = EngineSnapshot(num_running=1, num_waiting=0, kv_cache_usage=0.0, num_free_blocks=300, num_blocks=300,
                       prefix_cache_hit_rate=0.0, prompt_tokens=200, generation_tokens=5,
                       kv_offload=HostTierCounts(hit_tokens=16, bytes_saved=2048, failed_loads=1, num_slots=10))
    t = total_snapshot([a, b])
    assert (t.num_running, t.num_waiting, t.num_free_blocks, t.num_blocks) == (3, 1, 350, 400)
    assert t.kv_cache_usage == pytest.approx(50 / 400)
    # lookups: a 100 / (1 - 0.5) = 200 (100 hits), b 200 (no hits) -> 100 / 400
    assert t.prefix_cache_hit_rate == pytest.approx(0.25)
    assert (t.num_preemptions, t.prompt_tokens, t.generation_tokens) == (1, 300, 12)
    assert t.spec_decode == SpecDecodeCounts(2, 3, 6, 4, (3, 3), (3, 1))
    assert t.kv_offload == HostTierCounts(hit_tokens=48, bytes_saved=2048, bytes_loaded=4096, load_seconds=0.5,
                                          failed_loads=1, num_slots=20)  # the host tiers' totals
    assert total_snapshot([a]) is a


def test_replica_devices():
    assert replica_devices(2, 1, "cpu", "0,1", 2) == [None, None]
    assert replica_devices(2, 1, None, None, 0) == [None, None]  # no GPU: the CPU
    assert replica_devices(2, 1, None, None, 2) == ["0", "1"]
    assert replica_devices(2, 2, "cuda", "4,5,6,7", 4) == ["4,5", "6,7"]
    assert replica_devices(2, 1, "cuda", "3, 1,2", 3) == ["3", "1"]
    with pytest.raises(ConfigError, match="needs 4 GPUs; 2 are visible"):
        replica_devices(2, 2, "cuda", None, 2)
    with pytest.raises(ConfigError, match="names one GPU"):
        replica_devices(2, 1, "cuda:1", None, 2)


def test_cpu_threads_share_the_cores():
    assert [cpu_threads(n, 8) for n in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]


def test_a_replica_launch_sets_cuda_visible_devices_only_in_the_engine_process(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    launch = ReplicaLaunch("m", replica=1, cuda_visible_devices="1")
    assert pickle.loads(pickle.dumps(launch)) == launch
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # unpickled by the process that made it
    elsewhere = ReplicaLaunch("m", replica=1, cuda_visible_devices="1", server_pid=-1)  # as in the child
    pickle.loads(pickle.dumps(elsewhere))
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"


@pytest.mark.parametrize("flags, message", [
    (["--no-engine-process"], "needs the engines in processes of their own"),
    (["--api-server-count", "2"], "one API server process only"),
])
def test_flags_that_do_not_go_with_data_parallelism(flags, message):
    from tokenmill.entrypoints.cli import build_parser
    from tokenmill.entrypoints.serve_cli import _check_server_args

    args = build_parser().parse_args(["serve", "--data-parallel-size", "2", *flags])
    assert message in _check_server_args(args)
    args = build_parser().parse_args(["serve", "-dp", "1", *flags])
    assert _check_server_args(args) is None


# ---- DPEngineClient over stand-in replicas (no processes) ------------------------------------
class FakeReplica:
    """EngineCoreClient's surface as DPEngineClient uses it; its "step messages" come on a real zmq
    socket (send() puts one there)."""

    def __init__(self, ctx, index: int):
        import zmq

        from tokenmill.serve.core_wire import EngineFacts

        self.facts = EngineFacts("m", 64, 100, [0], 16, 4, f"fake {index}", 1000 + index)
        self.pid, self.summary, self.tokenizer = self.facts.pid, self.facts.summary, None
        self.model_name, self.max_model_len, self.vocab_size = "m", 64, 100
        self.structured = self.validator = None
        self._out = ctx.socket(zmq.PULL)
        self._out.bind(f"inproc://fake-{index}")
        self._feed = ctx.socket(zmq.PUSH)
        self._feed.connect(f"inproc://fake-{index}")
        self._backlog: list = []
        self.live: dict[str, int] = {}
        self.steps_completed, self.last_step_kind, self.dead = 0, None, False
        self.aborted: list[str] = []
        self.loras: set[int] = set()
        self.refuse_lora = False

    def send(self, *request_ids: str) -> None:
        self._feed.send_pyobj(list(request_ids))

    def step(self):
        from tokenmill.engine.outputs import CompletionOutput, RequestOutput

        if self._backlog:
            out, self._backlog = self._backlog, []
            return out
        if not self._out.poll(20):
            return []
        self.steps_completed += 1
        self.last_step_kind = "decode"
        return [RequestOutput(r, None, [1], [CompletionOutput(0, "", [7], None, None, "length")], True)
                for r in self._out.recv_pyobj()]

    def check_health(self) -> None:
        from tokenmill.serve.core_client import EngineProcessError

        if self.dead:
            raise EngineProcessError(f"the engine process {self.pid} exited with code -9 (killed by signal 9)")

    def add_request(self, prompt, params, request_id, prompt_ids, lora_request=None):
        self.live[request_id] = params.n
        return request_id

    def abort_request(self, request_id, sample=None):
        self.aborted.append(request_id)
        self.live.pop(request_id, None)
        return None

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def num_waiting_sequences(self) -> int:
        return sum(self.live.values())

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(num_blocks=16, num_free_blocks=16)

    def take_gc_pauses(self):
        return []

    def add_lora(self, lora_request) -> None:
        from tokenmill.errors import LoRAError

        if self.refuse_lora:
            raise LoRAError(f"replica {self.pid - 1000} refuses it")
        self.loras.add(lora_request.lora_int_id)

    def remove_lora(self, lora_int_id: int) -> bool:
        had = lora_int_id in self.loras
        self.loras.discard(lora_int_id)
        return had

    def list_loras(self):
        return sorted(self.loras)

    def reset_prefix_cache(self) -> bool:
        return not self.live


@pytest.fixture
def fakes():
    import zmq

    ctx = zmq.Context()
    replicas = [FakeReplica(ctx, i) for i in range(3)]
    yield replicas
    for r in replicas:
        r._out.close(0)
        r._feed.close(0)
    ctx.term()


def test_the_client_routes_polls_all_replicas_at_once_and_fails_by_name(fakes):
    from tokenmill.serve.core_client import EngineProcessError
    from tokenmill.serve.dp_client import DPEngineClient
    from tokenmill.errors import InvalidRequestError
    from tokenmill.sampling_params import SamplingParams

    client = DPEngineClient(fakes)
    params = SamplingParams(max_tokens=1)
    for i in range(6):
        client.add_request(None, params, f"r{i}", [1, 2, 3])
    assert [sorted(f.live) for f in fakes] == [["r0", "r3"], ["r1", "r4"], ["r2", "r5"]]
    assert client.num_waiting_sequences() == 6 and client.has_unfinished_requests()
    with pytest.raises(InvalidRequestError, match="already in use"):
        client.add_request(None, params, "r4", [1])
    client.abort_request("r4")
    assert fakes[1].aborted == ["r4"] and fakes[0].aborted == fakes[2].aborted == []
    assert client.replica_of("r4") is None and client.replica_of("r5") == 2
    waits = []
    for _ in range(3):
        started = time.monotonic()
        assert client.step() == []
        waits.append(time.monotonic() - started)
    assert min(waits) < 0.05  # nothing came: one 20 ms wait for all of them, not one per replica (60 ms)
    fakes[0].send("r0")
    fakes[2].send("r2", "r5")
    outs = client.step()
    assert sorted(o.request_id for o in outs) == ["r0", "r2", "r5"]
    assert client.steps_completed == 2 and client.replica_of("r0") is None
    stats = client.replica_stats()
    assert [s.routed for s in stats] == [2, 2, 2] and [s.steps for s in stats] == [1, 0, 1]
    assert client.snapshot().num_blocks == 48
    fakes[1].dead = True
    with pytest.raises(EngineProcessError, match=r"data-parallel replica 1 of 3: .*killed by signal 9"):
        client.check_health()


def test_lora_and_prefix_cache_resets_go_to_every_replica(fakes):
    from tokenmill.serve.dp_client import DPEngineClient
    from tokenmill.errors import LoRAError
    from tokenmill.lora.request import LoRARequest
    from tokenmill.sampling_params import SamplingParams

    client = DPEngineClient(fakes)
    client.add_lora(LoRARequest("a", 1, "/a"))
    assert [f.loras for f in fakes] == [{1}, {1}, {1}] and client.list_loras() == [1]
    fakes[2].refuse_lora = True
    with pytest.raises(LoRAError, match="replica 2 refuses it"):
        client.add_lora(LoRARequest("b", 2, "/b"))
    assert [f.loras for f in fakes] == [{1}, {1}, {1}]  # taken out again where it had gone in
    assert client.remove_lora(1) and [f.loras for f in fakes] == [set(), set(), set()]
    client.add_request(None, SamplingParams(max_tokens=1), "r", list(range(16)))
    assert len(client.balancer) == 4
    assert not client.reset_prefix_cache()  # one replica is busy: not every cache was reset
    fakes[0].live.clear()
    assert client.reset_prefix_cache() and len(client.balancer) == 0


# ---- a real server with two replicas ------------------------------------------------------------
@pytest.fixture(scope="module")
def launched():
    server = ServerProcess(SMALL_ENGINE + ["--data-parallel-size", "2"])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(launched):
    """The single in-process engine's greedy tokens (computed while the server starts)."""
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    llm = LLM(device="cpu", dtype="float32", num_kv_blocks=512, max_num_seqs=64)
    outs = llm.generate(BURST + [LONG], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return {prompt: list(out.outputs[0].token_ids) for prompt, out in zip(BURST + [LONG], outs)}


@pytest.fixture(scope="module")
def server(launched, reference):
    return launched.wait_ready()


def replica_metrics(server) -> dict[str, dict[int, float]]:
    """The tokenmill:replica_* samples: name -> {replica: value}."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    out: dict[str, dict[int, float]] = {}
    for m in re.finditer(r'^(tokenmill:replica_\w+)\{[^}]*replica="(\d+)"[^}]*\}\s+(\S+)$', text, re.M):
        out.setdefault(m.group(1), {})[int(m.group(2))] = float(m.group(3))
    return out


def test_startup_log_and_totals(server):
    log = server.log()
    assert "data parallel: 2 replicas" in log
    assert len(re.findall(r"data-parallel replica \d of 2: engine process \d+", log)) == 2
    m = server.metrics()
    assert m["tokenmill:data_parallel_size"] == 2
    per = replica_metrics(server)
    assert per["tokenmill:replica_num_kv_blocks"] == {0: 512, 1: 512}
    assert m["tokenmill:num_kv_blocks"] == 1024  # the unlabeled series: the totals
    assert m["tokenmill:num_kv_blocks_free"] == sum(per["tokenmill:replica_num_kv_blocks_free"].values())
    with open(f"/proc/{server.proc.pid}/maps") as f:  # the API server starts fast: torch is the replicas' alone
        assert "libtorch" not in f.read()


def test_a_burst_reaches_both_replicas_with_single_engine_results(server, reference):
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)

    async def one(prompt):
        r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        return r.choices[0]

    async def burst():
        try:
            return await asyncio.gather(*(one(p) for p in BURST))
        finally:
            await client.close()

    before = replica_metrics(server)
    choices = asyncio.run(burst())
    for prompt, choice in zip(BURST, choices):
        assert choice.model_extra["token_ids"] == reference[prompt], prompt
        assert choice.finish_reason in ("stop", "length")
    m = server.wait_idle()
    assert m["tokenmill:num_requests_running"] == 0 and m["tokenmill:num_requests_waiting"] == 0
    after = replica_metrics(server)
    routed = {r: after["tokenmill:replica_requests_routed_total"][r] -
              before["tokenmill:replica_requests_routed_total"][r] for r in (0, 1)}
    assert sum(routed.values()) == len(BURST)
    assert min(routed.values()) >= 3, routed  # balanced by load (these prompts are under one block)
    for r in (0, 1):
        assert after["tokenmill:replica_generation_tokens_total"][r] > 0
        assert after["tokenmill:replica_engine_steps_total"][r] > 0
    assert m["tokenmill:generation_tokens_total"] == sum(len(c.model_extra["token_ids"]) for c in choices)


def test_the_same_long_prompt_stays_on_one_replica(server, reference):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    before = replica_metrics(server)
    for _ in range(4):  # one after another: an idle server would otherwise alternate
        r = client.completions.create(model=MODEL, prompt=LONG, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].model_extra["token_ids"] == reference[LONG]
    server.wait_idle()
    after = replica_metrics(server)

    def delta(name):
        return {i: after[name][i] - before[name][i] for i in (0, 1)}

    routed, by_prefix = delta("tokenmill:replica_requests_routed_total"), delta(
        "tokenmill:replica_requests_routed_by_prefix_total")
    home = max(routed, key=routed.get)
    assert routed == {home: 4, 1 - home: 0}, routed
    assert by_prefix == {home: 3, 1 - home: 0}, by_prefix
    assert after["tokenmill:replica_prefix_cache_hit_rate"][home] > 0  # its cache served the repeats
    # A reset empties every replica's cache, and the balancer forgets where prefixes were.
    assert httpx.post(server.url + "/reset_prefix_cache", timeout=30).status_code == 200
    client.completions.create(model=MODEL, prompt=LONG, max_tokens=1, temperature=0)
    again = replica_metrics(server)
    assert again["tokenmill:replica_requests_routed_by_prefix_total"] == after[
        "tokenmill:replica_requests_routed_by_prefix_total"]


def _replica_pid(server, index: int) -> int:
    m = re.search(rf"data-parallel replica {index} of 2: engine process (\d+)", server.log())
    assert m, server.log()[-2000:]
    return int(m.group(1))


def test_killing_a_replica_gives_errors_and_exit_1_not_a_hang(server):
    """Last: the server is down afterwards."""
    body = {"model": MODEL, "prompt": "Count: one, two, three,", "max_tokens": 3000, "ignore_eos": True,
            "stream": True}
    results: list[list[str]] = [[], []]
    started = [threading.Event(), threading.Event()]

    def stream(i):
        try:
            with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        results[i].append(line[6:])
                        started[i].set()
        except httpx.HTTPError as e:
            results[i].append(f"transport error: {e}")
        started[i].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in started)
    per = replica_metrics(server)
    assert per["tokenmill:replica_num_requests_running"] == {0: 1, 1: 1}  # one on each (least loaded)
    os.kill(_replica_pid(server, 1), signal.SIGKILL)
    killed_at = time.monotonic()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert time.monotonic() - killed_at < 15
    for events in results:  # every stream ends with an error event and [DONE]
        assert events[-1] == "[DONE]", events[-3:]
        assert "data-parallel replica 1 of 2" in events[-2] and "killed by signal 9" in events[-2], events[-2]
    assert server.wait(30) == 1  # by itself: the engine failed, for its supervisor to restart it
    assert "data-parallel replica 1 of 2" in server.log() and "the server exits with status 1" in server.log()
    for index in (0, 1):  # both engine processes are gone with the server
        assert _wait_gone(_replica_pid(server, index), 30)


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(") ", 1)[1][0] in "ZX":
                    return True
        except OSError:
            return True
        time.sleep(0.1)
    return False
