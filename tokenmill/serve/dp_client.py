"""Data parallelism behind one API server: `DPEngineClient` drives N independent engine replicas.

`tokenmill serve --data-parallel-size N` (N > 1) starts N engine processes (each an ordinary
core_process engine with its own scheduler, KV cache and copy of the weights; on CUDA each sees its
own GPU(s) through CUDA_VISIBLE_DEVICES) and puts one DPEngineClient in front of them. The client
has the interface AsyncLLMEngine drives (the one EngineCoreClient has), so AsyncLLMEngine and the
whole server run unchanged on top of it:

- `add_request` picks a replica (ReplicaBalancer: the least loaded one, or the one that last served
  the same prompt prefix if its load is close to the least) and remembers which one owns the
  request; `abort_request` goes to that one. Request ids stay unique across replicas because this
  client refuses an id that is live on any of them.
- `step()` waits on the output sockets of every replica at once (one zmq poll, at most STEP_WAIT_S)
  and returns the outputs of every replica whose message came.
- `check_health()` fails (EngineProcessError naming the replica) as soon as any replica has died or
  failed; AsyncLLMEngine then fails every open stream at once and calls `restart()`, which restarts
  nothing here: it tells `on_give_up` and the server exits with status 1, for its supervisor to
  restart it (`--max-engine-restarts` applies to a single engine process only). A dead replica is
  not replaced and the others are not used on their own: the server goes down as a whole, so it
  never runs on with fewer replicas (and less capacity) than it was started with.
- `reset_prefix_cache`, `add_lora` and `remove_lora` go to every replica.
- `snapshot()` is the sum over the replicas (what /metrics' unlabeled totals and the waiting bound
  read); `replica_stats()` has each replica's own counters (/metrics' `tokenmill:replica_*` series).

Balancing (ReplicaBalancer, plain Python, no processes): a replica's load is its waiting + running
sequences from its latest step message plus the sequences sent to it since that the message did not
count yet. The prefix key of a prompt is a chain of hashes over its first AFFINITY_BLOCKS full
blocks of block_size tokens (and its LoRA adapter and cache salt: neither shares cached blocks); a bounded
LRU map remembers which replica last served each key. A new request goes to the replica of its
longest remembered key if that replica's load is at most min + max(ABS_MARGIN, REL_MARGIN x min)
(min: the least load of any replica), else to the least loaded replica (ties in turn, so an idle
server alternates). Either way its keys then point at the replica it went to.

Only one API server process: `--api-server-count` above 1 with data parallelism is refused (the
other API servers would need connections to every replica).
"""

import dataclasses
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional, Sequence

from tokenmill.config import ConfigError
from tokenmill.serve.core_client import (STARTUP_TIMEOUT_S, STEP_WAIT_S, STOP_TIMEOUT_S, EngineCoreClient,
                                          EngineProcessError)
from tokenmill.serve.core_process import EngineLaunch
from tokenmill.config import DataParallelRank
from tokenmill.engine.engine_snapshot import EngineSnapshot
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.spec_stats import SpecDecodeCounts
from tokenmill.kv_connector.counts import HostTierCounts, SharedStorageCounts
from tokenmill.errors import InvalidRequestError
from tokenmill.logger import init_logger
from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams

logger = init_logger(__name__)

AFFINITY_BLOCKS = 4  # prompt prefixes of 1..this many full blocks are remembered
AFFINITY_CAPACITY = 16384  # prefix keys remembered (least recently used forgotten)
ABS_MARGIN = 2  # the affinity replica may carry this many sequences more than the least loaded ...
REL_MARGIN = 0.10  # ... or this fraction of the least load, whichever is more
HEALTH_CHECK_S = 0.25  # while busy, every replica's process is looked at this often


# ---- balancing ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class BalancerConfig:
    num_replicas: int
    block_size: int
    affinity_blocks: int = AFFINITY_BLOCKS
    capacity: int = AFFINITY_CAPACITY
    abs_margin: int = ABS_MARGIN
    rel_margin: float = REL_MARGIN

    def __post_init__(self) -> None:
        if self.num_replicas < 1 or self.block_size < 1 or self.affinity_blocks < 0 or self.capacity < 1:
            raise ValueError(f"bad balancer config {self}")


@dataclass(frozen=True)
class Placement:
    """Where a request went and why."""

    replica: int
    by_prefix: bool  # the prefix-affinity rule chose it (else: the least loaded)


class ReplicaBalancer:
    """Chooses the replica of each new request from the replicas' loads and the prompt's prefix
    (see the module docstring). Not thread-safe: the engine thread alone uses it."""

    def __init__(self, config: BalancerConfig):
        self.config = config
        self._owners: OrderedDict[int, int] = OrderedDict()  # prefix key -> replica that last served it
        self._next_tie = 0

    def prefix_keys(self, prompt_ids: Sequence[int], lora_id: int = 0, cache_salt: Optional[str] = None) -> list[int]:
        """The keys of the prompt's first 1, 2, ... affinity_blocks full blocks (shortest first);
        requests of other adapters or cache salts share no cached blocks, so they get other keys."""
        bs = self.config.block_size
        keys, parent = [], hash(("tokenmill-dp", lora_id, cache_salt))
        for b in range(min(self.config.affinity_blocks, len(prompt_ids) // bs)):
            parent = hash((parent, tuple(prompt_ids[b * bs:(b + 1) * bs])))
            keys.append(parent)
        return keys

    def margin(self, min_load: int) -> float:
        return max(self.config.abs_margin, self.config.rel_margin * min_load)

    def choose(self, loads: Sequence[int], keys: Sequence[int]) -> Placement:
        """The replica for a request with these prefix keys, given each replica's load (read
        only: call `record` once it is sent)."""
        if len(loads) != self.config.num_replicas:
            raise ValueError(f"{len(loads)} loads for {self.config.num_replicas} replicas")
        least = min(loads)
        for key in reversed(keys):  # the longest remembered prefix first
            owner = self._owners.get(key)
            if owner is not None:
                if loads[owner] <= least + self.margin(least):
                    return Placement(owner, True)
                break  # its replica is busy: the least loaded one takes it (and the prefix)
        n = self.config.num_replicas
        tied = [(self._next_tie + i) % n for i in range(n) if loads[(self._next_tie + i) % n] == least]
        return Placement(tied[0], False)

    def record(self, placement: Placement, keys: Sequence[int]) -> None:
        """The request with these keys went to placement.replica."""
        if not placement.by_prefix:
            self._next_tie = (placement.replica + 1) % self.config.num_replicas
        for key in keys:
            self._owners[key] = placement.replica
            self._owners.move_to_end(key)
        while len(self._owners) > self.config.capacity:
            self._owners.popitem(last=False)

    def forget(self, replica: Optional[int] = None) -> None:
        """Forget the prefixes of one replica (or of all): its prefix cache was emptied."""
        if replica is None:
            self._owners.clear()
        else:
            for key in [k for k, r in self._owners.items() if r == replica]:
                del self._owners[key]

    def __len__(self) -> int:
        return len(self._owners)


# ---- devices -------------------------------------------------------------------------------------
def replica_devices(num_replicas: int, per_replica: int, device: Optional[str],
                    visible: Optional[str], device_count: int) -> list[Optional[str]]:
    """CUDA_VISIBLE_DEVICES for each replica (None: leave the environment as it is, e.g. on the CPU).
    visible: the server's own CUDA_VISIBLE_DEVICES (None if unset); device_count: the GPUs it sees."""
    if device is not None and not device.startswith("cuda"):
        return [None] * num_replicas
    if device is not None and ":" in device:
        raise ConfigError(f"--device {device} names one GPU; with data parallelism give --device cuda (each "
                          "replica then gets its own GPUs)")
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible is not None else \
        [str(i) for i in range(device_count)]
    if device is None and not ids:
        return [None] * num_replicas  # no GPU: the replicas run on the CPU
    needed = num_replicas * per_replica
    if len(ids) < needed:
        raise ConfigError(f"data parallelism with {num_replicas} replicas x {per_replica} GPU(s) each needs "
                          f"{needed} GPUs; {len(ids)} are visible")
    return [",".join(ids[i * per_replica:(i + 1) * per_replica]) for i in range(num_replicas)]


def cpu_threads(num_replicas: int, cores: int) -> int:
    """Torch threads for each of num_replicas replicas on the CPU: the cores shared out (more threads
    than cores, all spinning, make every replica several times slower)."""
    return max(1, cores // num_replicas)


@dataclass
class ReplicaLaunch(EngineLaunch):
    """An EngineLaunch that, unpickled in the spawned engine process (before anything touches CUDA),
    restricts that process to its replica's GPUs (cuda_visible_devices) or, on the CPU, to its share
    of the cores (cpu_threads)."""

    replica: int = 0
    cuda_visible_devices: Optional[str] = None
    cpu_threads: Optional[int] = None
    server_pid: int = field(default_factory=os.getpid)  # the process that made it (its settings stay)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if os.getpid() == self.server_pid:
            return
        # The engine process's own settings, before its engine is built.
        if self.cuda_visible_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = self.cuda_visible_devices
        if self.cpu_threads is not None:
            import torch

            os.environ["OMP_NUM_THREADS"] = str(self.cpu_threads)
            torch.set_num_threads(self.cpu_threads)


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cuda_device_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # no usable CUDA build
        return 0


# ---- the client ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplicaStats:
    """One replica as /metrics shows it (a copy, safe to read on any thread)."""

    index: int
    pid: Optional[int]
    snapshot: EngineSnapshot
    steps: int
    routed: int  # requests sent to it
    routed_by_prefix: int  # of which the prefix-affinity rule chose it


@dataclass
class _Counts:
    routed: list[int] = field(default_factory=list)
    by_prefix: list[int] = field(default_factory=list)


class _OutputSwitch:
    detokenize = False  # the engine processes send token ids; AsyncLLMEngine makes the text


class DPEngineClient:
    """N engine processes behind the interface of one EngineCoreClient (see the module docstring).
    `DPEngineClient.launch(launch, n)` starts them; `DPEngineClient(replicas)` wraps running ones."""

    @classmethod
    def launch(cls, launch: EngineLaunch, num_replicas: int, startup_timeout: float = STARTUP_TIMEOUT_S,
               balancer: Optional[BalancerConfig] = None) -> "DPEngineClient":
        """Start the replicas at once (each loads and warms up in its own process) and wait for all;
        if one fails to start, the others are stopped and its error is raised."""
        if num_replicas < 1:
            raise ConfigError("data_parallel_size must be at least 1")
        config = launch.config
        per_replica = config.tensor_parallel_size * config.pipeline_parallel_size
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        count = _cuda_device_count() if launch.device is None or launch.device.startswith("cuda") else 0
        devices = replica_devices(num_replicas, per_replica, launch.device, visible, count)
        fields = {f.name: getattr(launch, f.name) for f in dataclasses.fields(EngineLaunch)}
        if not config.enable_expert_parallel:  # independent replicas: each is one engine
            fields["config"] = dataclasses.replace(config, data_parallel_size=1)
        # With expert parallelism the replicas step together, in one process group (engine/dp_lockstep.py).
        rendezvous = f"tcp://127.0.0.1:{_free_port()}" if config.enable_expert_parallel else None
        on_cpu = launch.device == "cpu" or (launch.device is None and devices[0] is None)
        on_cpu = on_cpu and "OMP_NUM_THREADS" not in os.environ  # the user's own choice stays
        per_cpu = cpu_threads(num_replicas, len(os.sched_getaffinity(0))) if on_cpu else None
        launches = [ReplicaLaunch(**dict(fields, data_parallel=DataParallelRank(i, num_replicas, rendezvous)
                                         if rendezvous else None),
                                  replica=i, cuda_visible_devices=devices[i], cpu_threads=per_cpu)
                    for i in range(num_replicas)]
        clients: list[Optional[EngineCoreClient]] = [None] * num_replicas
        errors: list[Optional[BaseException]] = [None] * num_replicas

        def start(i: int) -> None:
            try:
                clients[i] = EngineCoreClient.launch(launches[i], startup_timeout=startup_timeout)
            except BaseException as e:
                errors[i] = e

        threads = [threading.Thread(target=start, args=(i,), name=f"tokenmill-dp-start-{i}") for i in
                   range(num_replicas)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = [i for i, e in enumerate(errors) if e is not None]
        if failed:
            _close_all([c for c in clients if c is not None], STOP_TIMEOUT_S)
            first = errors[failed[0]]
            if isinstance(first, EngineProcessError):
                raise EngineProcessError(f"data-parallel replica {failed[0]} of {num_replicas}: {first}") from first
            raise first
        for i, c in enumerate(clients):
            where = (f" on CUDA device(s) {devices[i]}" if devices[i] is not None else
                     f" ({per_cpu} CPU thread(s))" if per_cpu is not None else "")
            logger.info("data-parallel replica %d of %d: engine process %d%s", i, num_replicas, c.pid, where)
        return cls(clients, balancer)

    def __init__(self, replicas: Sequence[EngineCoreClient], balancer: Optional[BalancerConfig] = None):
        import zmq

        if not replicas:
            raise ValueError("no replicas")
        self.replicas = list(replicas)
        first = self.replicas[0]
        self.facts = first.facts
        self.tokenizer = first.tokenizer
        self.model_name = first.model_name
        self.max_model_len = first.max_model_len
        self.vocab_size = first.vocab_size
        self.structured = first.structured
        self.validator = first.validator
        self.block_size = first.facts.block_size
        self.summary = f"{first.summary}; data parallel: {len(self.replicas)} replicas"
        self.outputs = _OutputSwitch()
        self.pids = [r.pid for r in self.replicas]
        self.balancer = ReplicaBalancer(balancer or BalancerConfig(len(self.replicas), self.block_size))
        if self.balancer.config.num_replicas != len(self.replicas):
            raise ValueError("the balancer's num_replicas differs from the replicas given")
        self._counts = _Counts([0] * len(self.replicas), [0] * len(self.replicas))
        self._owner: dict[str, int] = {}  # live request id -> its replica
        self._poller = zmq.Poller()
        self._socket_of: dict[object, int] = {}
        for i, r in enumerate(self.replicas):
            sock = r._out  # the replica's step messages come on this socket (EngineCoreClient's own)
            self._poller.register(sock, zmq.POLLIN)
            self._socket_of[sock] = i
        self._last_health = time.monotonic()
        self._closed = False
        self.engine_restarts = 0  # a dead replica is never restarted (see restart)
        self.on_give_up = None  # told why when a replica has died (the server then exits 1)
        self.steps_completed = 0
        self.last_step_kind: Optional[str] = None

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    # ---- health and shutdown -----------------------------------------------------------------
    def _replica_error(self, index: int, error: EngineProcessError) -> EngineProcessError:
        message = f"data-parallel replica {index} of {self.num_replicas}: {error}"
        logger.error("%s", message)
        return EngineProcessError(message)

    def check_health(self) -> None:
        """EngineProcessError (naming the replica) if any replica's process has ended or failed."""
        self._last_health = time.monotonic()
        for i, r in enumerate(self.replicas):
            try:
                r.check_health()
            except EngineProcessError as e:
                raise self._replica_error(i, e) from None

    def restart(self) -> None:
        """A replica has died: nothing is restarted (see the module docstring); on_give_up is told
        and EngineProcessError raised."""
        dead = [(i, r.error or r._engine_exit()) for i, r in enumerate(self.replicas)]
        why = next((f"data-parallel replica {i} of {self.num_replicas}: {e}" for i, e in dead if e),
                   "a data-parallel replica failed")
        why += " (a replica is not restarted: the server exits)"
        logger.error("%s", why)
        if self.on_give_up is not None:
            self.on_give_up(why)
        raise EngineProcessError(why)

    def close(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop every replica's engine process (at once) and wait for them."""
        if self._closed:
            return
        self._closed = True
        _close_all(self.replicas, timeout)

    # ---- what AsyncLLMEngine drives ------------------------------------------------------------
    def tokenize(self, prompt, add_special_tokens: bool = True) -> list[int]:
        return self.validator.tokenize(prompt, add_special_tokens)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> int:
        return self.validator.validate(prompt_ids, params)

    def loads(self) -> list[int]:
        """Each replica's sequences: running and waiting at its last step message, plus those sent
        since that it had not taken yet."""
        return [r.snapshot().num_running + r.num_waiting_sequences() for r in self.replicas]

    def add_request(self, prompt, params: SamplingParams, request_id: str, prompt_ids: list[int],
                    lora_request: Optional[LoRARequest] = None) -> str:
        if request_id in self._owner:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        keys = self.balancer.prefix_keys(prompt_ids, lora_request.lora_int_id if lora_request is not None else 0,
                                         params.cache_salt)
        placement = self.balancer.choose(self.loads(), keys)
        i = placement.replica
        try:
            self.replicas[i].add_request(prompt, params, request_id, prompt_ids, lora_request)
        except EngineProcessError as e:
            raise self._replica_error(i, e) from None
        self.balancer.record(placement, keys)
        self._owner[request_id] = i
        self._counts.routed[i] += 1
        self._counts.by_prefix[i] += placement.by_prefix
        return request_id

    def replica_of(self, request_id: str) -> Optional[int]:
        return self._owner.get(request_id)

    def abort_request(self, request_id: str, sample: Optional[int] = None) -> Optional[RequestOutput]:
        i = self._owner.get(request_id)
        if i is None:
            return None
        out = self.replicas[i].abort_request(request_id, sample)
        if out is None or out.finished:
            self._owner.pop(request_id, None)
        return out

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    def num_waiting_sequences(self) -> int:
        return sum(r.num_waiting_sequences() for r in self.replicas)

    def snapshot(self) -> EngineSnapshot:
        return total_snapshot([r.snapshot() for r in self.replicas])

    def replica_stats(self) -> list[ReplicaStats]:
        """Each replica's counters (read from any thread: every value is copied or immutable)."""
        routed, by_prefix = list(self._counts.routed), list(self._counts.by_prefix)
        return [ReplicaStats(i, r.pid, r.snapshot(), r.steps_completed, routed[i], by_prefix[i])
                for i, r in enumerate(self.replicas)]

    def take_gc_pauses(self) -> list[tuple[int, float]]:
        pauses: list[tuple[int, float]] = []
        for r in self.replicas:
            pauses.extend(r.take_gc_pauses())
        return pauses

    def step(self) -> list[RequestOutput]:
        """The outputs of every replica whose step message has come: waits STEP_WAIT_S at most for
        the first (on all replicas' sockets at once); [] if none came."""
        pending = [i for i, r in enumerate(self.replicas) if r._backlog]  # outputs taken while checking health
        events = self._poller.poll(0 if pending else int(STEP_WAIT_S * 1000))
        ready = sorted(set(pending) | {self._socket_of[sock] for sock, _ in events})
        if not ready or time.monotonic() - self._last_health > HEALTH_CHECK_S:
            self.check_health()  # a replica that died sends nothing: look at every process now and then
        outputs: list[RequestOutput] = []
        for i in ready:
            r = self.replicas[i]
            before = r.steps_completed
            try:
                outs = r.step()  # returns at once: its message is there
            except EngineProcessError as e:
                raise self._replica_error(i, e) from None
            if r.steps_completed > before:
                self.steps_completed += r.steps_completed - before
                self.last_step_kind = r.last_step_kind
            for out in outs:
                if out.finished:
                    self._owner.pop(out.request_id, None)
            outputs.extend(outs)
        return outputs

    # ---- calls that go to every replica ----------------------------------------------------------
    def _each(self, name: str, *args) -> list:
        results = []
        for i, r in enumerate(self.replicas):
            try:
                results.append(getattr(r, name)(*args))
            except EngineProcessError as e:
                raise self._replica_error(i, e) from None
        return results

    def reset_prefix_cache(self) -> bool:
        """Every replica's; True only if all of them were idle and reset (the affinity map is
        forgotten for those that were)."""
        results = [bool(x) for x in self._each("reset_prefix_cache")]
        for i, ok in enumerate(results):
            if ok:
                self.balancer.forget(i)
        return all(results)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load the adapter in every replica; if one refuses it, it is removed from those that took it
        and the error is raised."""
        done = []
        try:
            for i, r in enumerate(self.replicas):
                r.add_lora(lora_request)
                done.append(i)
        except BaseException as e:
            for i in done:
                try:
                    self.replicas[i].remove_lora(lora_request.lora_int_id)
                except Exception:
                    logger.warning("replica %d: removing LoRA adapter %d again failed", i, lora_request.lora_int_id)
            if isinstance(e, EngineProcessError):
                raise self._replica_error(len(done), e) from None
            raise

    def remove_lora(self, lora_int_id: int) -> bool:
        return any(self._each("remove_lora", lora_int_id))

    def list_loras(self) -> list[int]:
        """The adapters every replica has."""
        lists = [set(x) for x in self._each("list_loras")]
        return sorted(set.intersection(*lists))


def _close_all(clients: Sequence[EngineCoreClient], timeout: float) -> None:
    threads = [threading.Thread(target=c.close, args=(timeout,), name=f"tokenmill-dp-close-{i}")
               for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def total_snapshot(snapshots: Sequence[EngineSnapshot]) -> EngineSnapshot:
    """The replicas' counters together: sums; KV usage over all blocks; the prefix-cache hit rate
    weighted by each replica's prompt lookups (estimated from its prompt tokens computed: those are
    the lookups that missed)."""
    if len(snapshots) == 1:
        return snapshots[0]
    blocks = sum(s.num_blocks for s in snapshots)
    usage = sum(s.kv_cache_usage * s.num_blocks for s in snapshots) / blocks if blocks else 0.0
    lookups = [s.prompt_tokens / (1.0 - s.prefix_cache_hit_rate) if s.prefix_cache_hit_rate < 0.999
               else float(s.prompt_tokens) for s in snapshots]
    hit_rate = (sum(s.prefix_cache_hit_rate * n for s, n in zip(snapshots, lookups)) / sum(lookups)
                if sum(lookups) > 0 else 0.0)
    specs = [s.spec_decode for s in snapshots if s.spec_decode is not None]
    spec = None
    if specs:
        k = max(x.num_speculative_tokens for x in specs)

        def at(name: str) -> tuple[int, ...]:
            padded = [tuple(getattr(x, name)) + (0,) * (k - x.num_speculative_tokens) for x in specs]
            return tuple(sum(v) for v in zip(*padded))

        spec = SpecDecodeCounts(k, sum(x.verify_steps for x in specs), sum(x.drafts for x in specs),
                                sum(x.accepted for x in specs), at("drafted_at"), at("accepted_at"))
    hosts = [s.kv_offload for s in snapshots if s.kv_offload is not None]
    host = (HostTierCounts(*(sum(getattr(h, f.name) for h in hosts) for f in dataclasses.fields(HostTierCounts)))
            if hosts else None)
    moved = [s.kv_transfer for s in snapshots if s.kv_transfer is not None]
    transfer = (SharedStorageCounts(*(sum(getattr(t, f.name) for t in moved)
                                      for f in dataclasses.fields(SharedStorageCounts))) if moved else None)
    return EngineSnapshot(
        num_running=sum(s.num_running for s in snapshots), num_waiting=sum(s.num_waiting for s in snapshots),
        kv_cache_usage=usage, num_free_blocks=sum(s.num_free_blocks for s in snapshots), num_blocks=blocks,
        prefix_cache_hit_rate=hit_rate, num_preemptions=sum(s.num_preemptions for s in snapshots),
        prompt_tokens=sum(s.prompt_tokens for s in snapshots),
        generation_tokens=sum(s.generation_tokens for s in snapshots),
        kernel_compiles_after_warmup=sum(s.kernel_compiles_after_warmup for s in snapshots),
        kernel_compile_seconds_after_warmup=sum(s.kernel_compile_seconds_after_warmup for s in snapshots),
        spec_decode=spec, kv_offload=host, kv_transfer=transfer)
