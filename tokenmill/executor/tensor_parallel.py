"""Tensor parallelism: one process per rank, each with its own runner over its shard of the weights.

The driver is rank 0: the process of the engine and the scheduler. It starts the other ranks as
worker processes (or, under torchrun, finds them started), and each rank builds the model inside
`tensor_parallel(...)` so its layers hold only their shard (distributed.py; each checkpoint tensor
is read, narrowed to the rank's part and dropped, so no rank ever holds the whole model) and run
their all-reduces in the group. The engine drives a TPExecutor as it would a ModelRunner: every
call that touches the device (set-up, each step's execute_model and sample_tokens, releasing rows)
is sent to the workers first (executor/step_wire.py: msgpack over a broadcast in a gloo group, a
length then the bytes) and then run on rank 0's own runner. All ranks thus run the same steps in the
same order: the logits are gathered over the vocabulary on every rank, so every rank samples the
same tokens (the samplers are seeded per request) and keeps the same request state, and only rank
0's sampled tokens go back to the engine. NCCL carries the model's collectives on CUDA (one GPU per
rank: cuda:<local rank>), gloo on the CPU; the control group is always gloo.

Workers start as `python -m tokenmill.executor.worker` (executor/worker.py): a fresh interpreter
that imports only tokenmill, never the user's main module (a script read from stdin works, and no
`if __name__ == "__main__"` guard is needed). Rank 0 holds a TCPStore that hands them the RankLaunch;
each worker marks itself joined (before the process group) and ready (its shard built) there, and
rank 0 waits for both marks while watching the processes, so a worker that exits during start-up
fails the engine's construction at once with TPWorkerError carrying the tail of its stderr.
A worker that exits later (killed, out of memory) fails the driver's next step with an error naming
it; a worker whose driver is gone exits.
"""

import atexit
import collections
import dataclasses
import datetime
import os
import pickle
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.distributed import ParallelState, tensor_parallel
from tokenmill.errors import TokenmillError
from tokenmill.executor import step_wire
from tokenmill.logger import init_logger

logger = init_logger(__name__)

CONTROL_TIMEOUT = datetime.timedelta(days=365)  # workers wait on the control broadcast while idle
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
START_TIMEOUT_S = 600.0
PARENT_CHECK_S = 1.0
START_POLL_S = 0.05  # how often rank 0 looks at the store and the worker processes during start-up
STDERR_TAIL_LINES = 30  # of a worker's stderr, kept for the error that reports its exit
LAUNCH_KEY = "tokenmill/launch"
# The environment of a spawned worker (executor/worker.py reads it).
ENV_RANK, ENV_WORLD, ENV_STORE, ENV_PARENT = ("TOKENMILL_TP_RANK", "TOKENMILL_TP_WORLD_SIZE", "TOKENMILL_TP_STORE",
                                              "TOKENMILL_TP_PARENT_PID")


class TPWorkerError(TokenmillError, RuntimeError):
    """A tensor-parallel worker process exited (during start-up: with the end of its own stderr)."""


def _joined_key(rank: int) -> str:
    return f"tokenmill/joined/{rank}"


def _ready_key(rank: int) -> str:
    return f"tokenmill/ready/{rank}"


@dataclass
class RankLaunch:
    """What every rank needs to build its model and runner (sent once, at start)."""

    model: Optional[str]
    load_format: str
    dtype: object
    device_type: str  # "cpu" or "cuda"
    config: EngineConfig
    max_positions: Optional[int]
    seed: int
    init_method: str  # "store": rank 0's TCPStore (spawned workers); env:// under torchrun
    world_size: int
    tokenizer: Optional[str] = None  # a tokenizer instead of the model's (rank 0 only needs one)


def check_tensor_parallel(arch, tp: int) -> None:
    """Refuse, naming the numbers, a model whose heads or MLP do not split over tp ranks."""
    if tp == 1:
        return
    problems = []
    if arch.num_heads % tp:
        problems.append(f"its {arch.num_heads} attention heads")
    kv = arch.num_kv_heads
    if kv % tp and tp % kv:
        problems.append(f"its {kv} KV heads (tp must divide them, or be a multiple of them: KV heads are "
                        "then replicated)")
    if arch.intermediate_size % tp:
        problems.append(f"its MLP width {arch.intermediate_size}")
    moe = arch.moe
    if moe is not None and moe.intermediate_size % tp:
        problems.append(f"its experts' width {moe.intermediate_size}")
    if moe is not None and moe.shared_expert_intermediate_size % tp:
        problems.append(f"its shared expert's width {moe.shared_expert_intermediate_size}")
    if problems:
        raise ConfigError(f"tensor_parallel_size {tp} does not split {arch.architecture}: {'; '.join(problems)}")


def check_supported(config: EngineConfig) -> None:
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if tp * pp == 1:
        return
    if pp > 1:
        if config.speculative_config is not None:
            raise ConfigError("speculative decoding with pipeline_parallel_size > 1 is not supported yet")
        if config.step_time_target_ms is not None:
            raise ConfigError("step_time_target_ms with pipeline_parallel_size > 1 is not supported yet")
    if config.enable_lora:
        raise ConfigError("LoRA with tensor or pipeline parallelism is not supported yet")
    if tp == 1:
        return
    spec = config.speculative_config
    if spec is not None and spec.method == "draft_model":
        raise ConfigError("speculative method draft_model with tensor_parallel_size > 1 is not supported yet "
                          "(ngram and layer_truncated are)")
    if config.step_time_target_ms is not None:
        raise ConfigError("step_time_target_ms with tensor_parallel_size > 1 is not supported yet")


def under_torchrun() -> bool:
    """Started by torchrun (its standard environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


class ControlChannel:
    """Rank 0 broadcasts each message to the other ranks: its length, then its bytes (gloo)."""

    def __init__(self, group):
        self.group = group
        self._len = torch.zeros(1, dtype=torch.int64)

    def send(self, data: bytes) -> None:
        self._len[0] = len(data)
        dist.broadcast(self._len, src=0, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=self.group)

    def recv(self) -> bytes:
        dist.broadcast(self._len, src=0, group=self.group)
        buf = torch.empty(int(self._len[0]), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.group)
        return buf.numpy().tobytes()


def _init_rank(launch: RankLaunch, rank: int, store=None) -> tuple[torch.device, object, ParallelState, object]:
    """Join the process group; returns this rank's device, the control group, its place (with
    pipeline stages: its stage's tensor-parallel group, every rank creating every group in order)
    and, with pipeline stages, the group of the stages' sends."""
    cuda = launch.device_type == "cuda"
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    where = dict(store=store) if store is not None else dict(init_method=launch.init_method)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=launch.world_size,
                            timeout=COLLECTIVE_TIMEOUT, **where)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    tp, pp = launch.config.tensor_parallel_size, launch.config.pipeline_parallel_size
    group = p2p = None  # one stage: the tensor-parallel group is the world
    if pp > 1:
        from tokenmill.executor.pipeline import rank_of

        p2p = dist.new_group()
        for stage in range(pp):
            ranks = [rank_of(stage, t, tp, pp) for t in range(tp)]
            g = dist.new_group(ranks=sorted(ranks))
            if rank in ranks:
                group = g
    from tokenmill.executor.pipeline import stage_of

    state = ParallelState(tp_rank=rank % tp, tp_size=tp, group=group, pp_rank=stage_of(rank, tp, pp), pp_size=pp,
                          expert_parallel=launch.config.enable_expert_parallel,
                          microbatching=launch.config.enable_microbatching)
    return device, control, state, p2p


def _build(launch: RankLaunch, rank: int, device: torch.device, state: ParallelState, p2p=None):
    """This rank's model shard (its stage's layers, its tensor-parallel part of each) and runner."""
    from tokenmill.loader import load_model
    from tokenmill.runner.model_runner import ModelRunner

    with tensor_parallel(state):
        loaded = load_model(launch.model, dtype=launch.dtype, device=device, load_format=launch.load_format,
                            max_positions=launch.max_positions, seed=launch.seed,
                            tokenizer=launch.tokenizer if rank == 0 else None,
                            quantization=launch.config.quantization, with_tokenizer=rank == 0)
    max_model_len = launch.config.resolve_max_model_len(loaded.arch.max_position_embeddings)
    runner = ModelRunner(loaded.model, launch.config, max_model_len, loaded.device, loaded.dtype)
    if state.pp_size > 1:
        from tokenmill.executor.pipeline import PipelineLink

        runner.pipeline = PipelineLink(state.pp_rank, state.pp_size, state.tp_rank, state.tp_size,
                                       loaded.arch.hidden_size, loaded.dtype, loaded.device, p2p_group=p2p)
    return loaded, runner


def _watch_parent(parent_pid: Optional[int]) -> None:
    if parent_pid is None:
        return

    def watch():
        while True:
            time.sleep(PARENT_CHECK_S)
            if os.getppid() != parent_pid:
                logger.error("tensor-parallel worker: the driver process is gone; exiting")
                os._exit(1)

    threading.Thread(target=watch, name="tokenmill-tp-parent-watch", daemon=True).start()


def run_spawned_worker(store_address: str, rank: int, world_size: int, parent_pid: int) -> int:
    """A worker rank that rank 0 started (executor/worker.py): its RankLaunch comes from rank 0's
    store, where it marks itself joined, then (run_worker) ready."""
    _watch_parent(parent_pid)
    host, port = store_address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    launch = pickle.loads(store.get(LAUNCH_KEY))
    store.set(_joined_key(rank), b"1")
    return run_worker(launch, rank, store=store)


def run_worker(launch: RankLaunch, rank: int, store=None) -> int:
    """A worker rank: build the shard and runner, then run what the driver sends until it says stop."""
    device, control, state, p2p = _init_rank(launch, rank, store)
    channel = ControlChannel(control)
    _, runner = _build(launch, rank, device, state, p2p)
    if store is not None:
        store.set(_ready_key(rank), b"1")
    logger.info("tensor-parallel rank %d/%d ready on %s", rank, launch.world_size, device)
    stage = last = None  # with pipeline stages: this rank's steps in flight (executor/pipeline.py)
    if runner.pipeline is not None:
        from tokenmill.executor.pipeline import LastStageSteps, StageSteps

        if runner.pipeline.is_last:
            last = LastStageSteps(runner)
        else:
            stage = StageSteps(runner, runner.pipeline)
    with torch.inference_mode():
        while True:
            msg = step_wire.decode(channel.recv())
            kind = msg[0]
            if kind == "exec":
                if stage is not None:
                    stage.execute(msg[1])
                elif last is not None:
                    last.execute(msg[1])
                else:
                    runner.execute_model(msg[1])
            elif kind == "sample":  # rank 0's tokens are the ones the engine takes
                if stage is not None:
                    stage.finish()
                elif last is not None:
                    last.sample(msg[1])
                else:
                    runner.sample_tokens(msg[1])
            elif kind == "release":
                (last or runner).release(msg[1])
            elif kind == "call":
                _, name, args = msg
                _call(runner, name, args, control)
            elif kind == "shutdown":
                break
    dist.destroy_process_group()
    return 0


def _call(runner, name: str, args: list, control):
    if name == "initialize_kv_cache":
        return runner.initialize_kv_cache(agree=lambda n: _agree_min(n, control))
    if name in ("warm_up", "capture_cuda_graphs"):
        return getattr(runner, name)()
    if name == "dummy_run":
        return runner.dummy_run(*args)
    raise ValueError(f"unknown runner call {name!r}")


def _agree_min(n: int, control) -> int:
    """The smallest of every rank's n (KV blocks: the cache must be as large on every rank)."""
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=control)
    return int(t[0])


def torchrun_worker(model, config: EngineConfig, *, dtype, device, load_format: str) -> int:
    """A rank other than 0 under torchrun (the same command runs on every rank: rank 0 serves, the
    others run this): a worker of rank RANK of WORLD_SIZE, its group from torchrun's environment."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != config.tensor_parallel_size * config.pipeline_parallel_size:
        raise ConfigError(f"torchrun started {world} ranks but tensor_parallel_size x pipeline_parallel_size is "
                          f"{config.tensor_parallel_size * config.pipeline_parallel_size}")
    if config.pipeline_parallel_size > 1:
        config = dataclasses.replace(config, enforce_eager=True)
    device_type = _device_type(device)
    launch = RankLaunch(model, load_format, dtype, device_type, config, config.max_model_len, config.seed,
                        "env://", world)
    logger.info("torchrun rank %d of %d: a tensor-parallel worker", rank, world)
    return run_worker(launch, rank)


def _device_type(device) -> str:
    if device is not None:
        return torch.device(device).type
    return "cuda" if torch.cuda.is_available() else "cpu"


class _WorkerProcess:
    """A spawned worker rank: its process, and the tail of its stderr (passed on to ours as it
    comes; a pipe that is read, so the worker never blocks on it)."""

    def __init__(self, rank: int, store_address: str, world_size: int):
        self.rank = rank
        env = dict(os.environ, **{ENV_RANK: str(rank), ENV_WORLD: str(world_size), ENV_STORE: store_address,
                                  ENV_PARENT: str(os.getpid())})
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above tokenmill/
        env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self.proc = subprocess.Popen([sys.executable, "-m", "tokenmill.executor.worker"], env=env,
                                     stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.pid = self.proc.pid
        self._tail: collections.deque = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._reader = threading.Thread(target=self._read, name=f"tokenmill-tp-{rank}-stderr", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in iter(self.proc.stderr.readline, b""):
            text = line.decode("utf-8", "replace")
            self._tail.append(text.rstrip("\n"))
            try:
                sys.stderr.write(text)
            except (OSError, ValueError):  # our stderr is closed: keep draining the pipe
                pass
        self.proc.stderr.close()

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def exit_error(self, when: str) -> Optional[TPWorkerError]:
        """The error that reports this worker's exit, or None while it runs."""
        code = self.proc.poll()
        if code is None:
            return None
        self._reader.join(2.0)  # its last lines
        how = f"killed by signal {-code}" if code < 0 else f"code {code}"
        tail = "\n".join(self._tail).strip()
        return TPWorkerError(f"tensor-parallel worker rank {self.rank} exited ({how}){' ' + when if when else ''}" +
                             (f"; its last output:\n{tail}" if tail else ""))


class TPExecutor:
    """Rank 0's runner and the worker ranks behind it, driven as one ModelRunner by the engine."""

    def __init__(self, launch: RankLaunch):
        self.launch = launch
        self.world_size = launch.world_size
        self._procs: list[_WorkerProcess] = []
        self._closed = False
        store = None
        try:
            if launch.init_method != "env://":  # not under torchrun: start the other ranks here
                store = dist.TCPStore("127.0.0.1", 0, self.world_size, is_master=True, wait_for_workers=False,
                                      timeout=COLLECTIVE_TIMEOUT)
                store.set(LAUNCH_KEY, pickle.dumps(launch))
                address = f"127.0.0.1:{store.port}"
                self._procs = [_WorkerProcess(rank, address, self.world_size) for rank in range(1, self.world_size)]
                self._wait_for(store, _joined_key, "joined the process group")
            device, control, state, p2p = _init_rank(launch, 0, store)
            self.control = control
            self.channel = ControlChannel(control)
            self.loaded, self.runner = _build(launch, 0, device, state, p2p)
            if store is not None:
                self._wait_for(store, _ready_key, "built their shards")
        except BaseException:
            self._kill_workers()
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        self.steps = None  # with pipeline stages: rank 0's (the last stage's) queued steps
        if self.runner.pipeline is not None:
            from tokenmill.executor.pipeline import LastStageSteps

            self.steps = LastStageSteps(self.runner, lambda bitmask: self._send(step_wire.encode_sample(bitmask)))
        atexit.register(self.close)
        logger.info("tensor x pipeline parallelism: %d x %d ranks (%s)", launch.config.tensor_parallel_size,
                    launch.config.pipeline_parallel_size, "NCCL" if launch.device_type == "cuda" else "gloo")

    @classmethod
    def launch(cls, model, config: EngineConfig, *, dtype, device, load_format: str, seed: int,
               tokenizer: Optional[str] = None) -> "TPExecutor":
        device_type = _device_type(device)
        world = config.tensor_parallel_size * config.pipeline_parallel_size
        if config.pipeline_parallel_size > 1 and not config.enforce_eager:
            logger.info("pipeline parallelism runs its steps eagerly (no CUDA graphs)")
            config = dataclasses.replace(config, enforce_eager=True)
        if under_torchrun():
            if int(os.environ["WORLD_SIZE"]) != world:
                raise ConfigError(f"torchrun started {os.environ['WORLD_SIZE']} ranks but tensor_parallel_size x "
                                  f"pipeline_parallel_size is {world}")
            init = "env://"
        else:
            init = "store"
        return cls(RankLaunch(model, load_format, dtype, device_type, config, config.max_model_len, seed, init,
                              world, tokenizer))

    # ---- what the engine calls, as on a ModelRunner ------------------------------------------
    def _send(self, data: bytes) -> None:
        self._check_workers()
        self.channel.send(data)

    def _check_workers(self, when: str = "") -> None:
        for p in self._procs:
            error = p.exit_error(when)
            if error is not None:
                raise error

    def _wait_for(self, store, key, what: str) -> None:
        """Until every worker has set its key in the store; TPWorkerError as soon as one exits."""
        deadline = time.monotonic() + START_TIMEOUT_S
        pending = set(range(1, self.world_size))
        while pending:
            pending = {rank for rank in pending if not store.check([key(rank)])}
            self._check_workers("while starting")
            if pending and time.monotonic() > deadline:
                raise TPWorkerError(f"tensor-parallel worker rank(s) {sorted(pending)} had not {what} "
                                    f"within {START_TIMEOUT_S:.0f} s")
            if pending:
                time.sleep(START_POLL_S)

    def initialize_kv_cache(self) -> int:
        self._send(step_wire.encode("call", "initialize_kv_cache", []))
        return self.runner.initialize_kv_cache(agree=lambda n: _agree_min(n, self.control))

    def warm_up(self) -> None:
        self._send(step_wire.encode("call", "warm_up", []))
        self.runner.warm_up()

    def capture_cuda_graphs(self) -> None:
        self._send(step_wire.encode("call", "capture_cuda_graphs", []))
        self.runner.capture_cuda_graphs()

    def dummy_run(self, *args):
        self._send(step_wire.encode("call", "dummy_run", list(args)))
        return self.runner.dummy_run(*args)

    @property
    def steps_ahead(self) -> int:
        """Steps the engine keeps in flight beyond the one it completes: pp - 1 with pipeline
        stages (each stage then has one), else 0."""
        return self.launch.config.pipeline_parallel_size - 1

    def execute_model(self, out) -> None:
        self._send(step_wire.encode_exec(out))
        if self.steps is not None:  # the stages before the last start it now; rank 0 runs it when asked
            self.steps.execute(out)
        else:
            self.runner.execute_model(out)

    def sample_tokens(self, grammar_bitmask=None):
        if self.steps is not None:
            from tokenmill.executor.pipeline import DeferredOutput

            return DeferredOutput(self.steps, grammar_bitmask)
        self._send(step_wire.encode_sample(grammar_bitmask))
        return self.runner.sample_tokens(grammar_bitmask)

    def release(self, req_ids: list[str]) -> None:
        if req_ids:
            self._send(step_wire.encode("release", list(req_ids)))
        (self.steps or self.runner).release(req_ids)

    def __getattr__(self, name):  # everything else (speculates, states, ...) reads rank 0's runner
        if name in ("runner", "launch", "channel", "control", "_procs", "steps"):
            raise AttributeError(name)
        return getattr(self.runner, name)

    # ---- shutdown ----------------------------------------------------------------------------
    def close(self, timeout: float = 30.0) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            if all(p.proc.poll() is None for p in self._procs):
                self.channel.send(step_wire.encode("shutdown"))
        except Exception as e:  # a worker already gone
            logger.debug("tensor-parallel shutdown message failed: %r", e)
        deadline = time.monotonic() + timeout
        for p in self._procs:
            try:
                p.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._kill_workers()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _kill_workers(self) -> None:
        for p in self._procs:
            if p.proc.poll() is None:
                p.proc.kill()
                try:
                    p.proc.wait(5)
                except subprocess.TimeoutExpired:
                    logger.warning("tensor-parallel worker rank %d did not end after SIGKILL", p.rank)
