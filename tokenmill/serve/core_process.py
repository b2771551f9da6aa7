"""The engine process: an LLMEngine (scheduler + runner) driven by the messages of its API servers.

`run_engine_process(launch, engine_dir, parent_pid)` is the target of the process the API server
spawns. It loads the model, warms up, tells API server 0 (the one that started it) its facts
("ready"), then loops:

- a *receiver* thread takes the servers' messages off the input socket, decodes them, compiles the
  grammars of new requests (so compiling never runs on the step loop; the engine's grammar cache
  then has them) and queues them for the loop. It also watches the parent: if the API server
  process that started it is gone, the engine shuts down.
- the main thread carries the queued commands out between steps (add, abort, named calls, hello
  and detach of further API servers, shutdown), steps while there is work, and after each step
  sends every API server one message with what changed for its requests (core_messages: token-id
  deltas, finish reasons, the engine's counters). With no work it blocks on the queue.

With `--api-server-count N`, servers 1..N-1 say "hello" when they start; requests carry their
server's index in their engine-side id ("<index>/<id>"), so each step's outputs go back to the
server that sent them.

Garbage collection stays off the step path: everything alive after warm-up is frozen (never scanned
again), automatic full (generation-2) collections are off, and a full collection runs when the
engine goes idle (gc_policy). The pauses of every collection are timed and sent with the step
messages, so the server's metrics show them.

The process ignores SIGINT and SIGTERM: the API server decides when it ends (a Ctrl-C reaches the
whole process group) and sends "shutdown"; everything still running is aborted then.
"""

import os
import pickle
import queue
import signal
import threading
from dataclasses import dataclass, field
from typing import Optional

from tokenmill.config import DataParallelRank, EngineConfig
from tokenmill.serve.core_wire import (CALLS, EngineFacts, RequestProgress, lora_from_wire, output_delta,
                                            pack, params_from_wire, state_delta, unpack)
from tokenmill.serve.gc_policy import GCPolicy
from tokenmill.errors import TokenmillError
from tokenmill.logger import dump_stacks_on_sigusr1, init_logger

logger = init_logger(__name__)

PARENT_CHECK_SECONDS = 1.0
LOCKSTEP_IDLE_WAIT_S = 0.005  # replicas that step together poll for requests this long between agreements


@dataclass
class EngineLaunch:
    """What the engine process needs to build its engine (picklable: it crosses to a spawned
    process once, at start-up)."""

    model: Optional[str]
    config: EngineConfig = field(default_factory=EngineConfig)
    dtype: str = "auto"
    device: Optional[str] = None
    load_format: str = "auto"
    tokenizer: Optional[str] = None
    log_level: Optional[int] = None
    # Data parallelism with expert parallelism: this replica's rank among those that step together.
    data_parallel: Optional[DataParallelRank] = None


def addresses(engine_dir: str, index: int) -> tuple[str, str]:
    """The engine's input address and API server `index`'s output address (ipc paths in engine_dir)."""
    return f"ipc://{os.path.join(engine_dir, 'in')}", f"ipc://{os.path.join(engine_dir, f'out-{index}')}"


def run_engine_process(launch: EngineLaunch, engine_dir: str, parent_pid: int) -> None:
    """The engine process's main: runs until a shutdown (or a lost parent), then exits the process."""
    import zmq

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    dump_stacks_on_sigusr1()
    # Progress bars (loading) would otherwise make a multiprocessing lock, a named semaphore that this
    # process's exit (os._exit, below) never unlinks: the server's resource tracker reports it leaked.
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    if launch.log_level is not None:
        import logging

        from tokenmill.logger import set_log_level

        set_log_level(logging.getLevelName(launch.log_level))
    ctx = zmq.Context(io_threads=1)
    outs = Outputs(ctx, engine_dir)
    outs.connect(0)  # the API server that started us: it hears why, if we cannot start
    try:
        core = EngineCore(launch, outs)
    except BaseException as e:
        if isinstance(e, TokenmillError):  # a bad model path, an option the model cannot take: said once, there
            message = str(e)
        else:
            logger.exception("the engine could not start")
            message = f"the engine could not start: {type(e).__name__}: {e}"
        outs.send(0, ["failed", message])
        outs.close()
        ctx.term()
        raise SystemExit(1)
    inp = ctx.socket(zmq.PULL)
    inp.bind(addresses(engine_dir, 0)[0])
    receiver = threading.Thread(target=core.receive, args=(inp, parent_pid), name="tokenmill-engine-recv",
                                daemon=True)
    receiver.start()
    core.send_ready(0)
    status = core.run()
    core.stopping = True
    receiver.join(timeout=2 * PARENT_CHECK_SECONDS + 1)
    outs.close()
    if not receiver.is_alive():
        inp.close()
        ctx.term()  # waits until the last messages are sent (LINGER)
    os._exit(status)  # skip interpreter teardown (CUDA and Triton's native state)


class Outputs:
    """One PUSH socket per API server (index 0 from the start, the others when they say hello).
    Sends never block the step loop: a server whose socket is full (gone, or stuck) is dropped."""

    def __init__(self, ctx, engine_dir: str):
        import zmq

        self._zmq = zmq
        self._ctx = ctx
        self._dir = engine_dir
        self.sockets: dict[int, object] = {}

    def connect(self, index: int) -> None:
        sock = self._ctx.socket(self._zmq.PUSH)
        sock.setsockopt(self._zmq.LINGER, 5000)
        sock.setsockopt(self._zmq.SNDHWM, 100_000)
        sock.connect(addresses(self._dir, index)[1])
        self.sockets[index] = sock

    def send(self, index: int, message) -> bool:
        sock = self.sockets.get(index)
        if sock is None:
            return False
        try:
            sock.send(pack(message), flags=self._zmq.NOBLOCK)
            return True
        except self._zmq.Again:
            logger.error("API server %d does not take the engine's messages (gone?); it is dropped", index)
            self.drop(index)
            return False

    def drop(self, index: int) -> None:
        sock = self.sockets.pop(index, None)
        if sock is not None:
            sock.close(linger=0)

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close()
        self.sockets.clear()


def client_of(request_id: str) -> int:
    """The API server a request came from: the engine-side request id is "<server index>/<its id>"."""
    return int(request_id.split("/", 1)[0])


class EngineCore:
    def __init__(self, launch: EngineLaunch, outs: Outputs):
        from tokenmill.engine.llm_engine import LLMEngine

        self.outs = outs
        self.engine = LLMEngine(launch.model, launch.config, dtype=launch.dtype, device=launch.device,
                                load_format=launch.load_format, tokenizer=launch.tokenizer,
                                data_parallel=launch.data_parallel)
        self.engine.outputs.detokenize = False  # the API servers make the text
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.progress: dict[str, RequestProgress] = {}  # what was sent of each live request
        self.adds_seen: dict[int, int] = {}  # per API server: its add messages carried out
        self.needs_step = False
        self.stopping = False  # set when the loop has ended: the receiver thread ends too
        self.gc = GCPolicy()
        self.gc.start()  # after loading and warm-up: what exists now lives as long as the process
        self._facts = None

    def facts(self) -> dict:
        from dataclasses import asdict

        from tokenmill.engine.llm_engine import engine_summary

        if self._facts is None:
            e = self.engine
            tokenizer = pickle.dumps(e.tokenizer) if e.tokenizer is not None else None
            self._facts = asdict(EngineFacts(e.model_name, e.max_model_len, e.vocab_size,
                                             list(e.loaded.eos_token_ids), e.kv.num_blocks, e.config.block_size,
                                             engine_summary(e), os.getpid(), tokenizer))
        return self._facts

    def send_ready(self, index: int) -> None:
        self.adds_seen.setdefault(index, 0)
        facts = dict(self.facts(), snapshot=self.engine.snapshot().to_wire())
        self.outs.send(index, ["ready", facts])

    # ---- the receiver thread ---------------------------------------------------------------
    def receive(self, sock, parent_pid: int) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self.stopping:
            if not poller.poll(PARENT_CHECK_SECONDS * 1000):
                if os.getppid() != parent_pid:
                    logger.error("the API server process is gone; the engine shuts down")
                    self.commands.put(["shutdown"])
                    return
                continue
            message = unpack(sock.recv())
            if message[0] == "add":
                message[4] = params_from_wire(message[4])
                spec = message[4].structured_outputs
                if spec is not None:
                    try:
                        self.engine.structured.compile(spec)  # thread-safe; add_request finds it cached
                    except Exception:
                        pass  # add_request raises it again, and the server hears why
            self.commands.put(message)
            if message[0] == "shutdown":
                return

    # ---- the main loop ---------------------------------------------------------------------
    def run(self) -> int:
        engine = self.engine
        lockstep = engine.lockstep is not None  # replicas that step together: step while any has work
        try:
            while True:
                idle = not engine.has_unfinished_requests() and not self.needs_step and not engine.dp_busy
                if idle:
                    self.gc.on_idle()
                stop = False
                for message in self._take(block=idle, timeout=LOCKSTEP_IDLE_WAIT_S if lockstep else None):
                    stop = self._execute(message) or stop
                if stop and lockstep:  # said in the next agreement; every replica then stops together
                    engine.dp_stop_requested = True
                    stop = False
                if stop or engine.dp_stopped:
                    self._shutdown()
                    return 0
                if lockstep or engine.has_unfinished_requests() or self.needs_step:
                    self.needs_step = False
                    completed = engine.steps_completed
                    outputs = engine.step(emit_unfinished=False)  # the others: engine.changed_unfinished
                    kind = engine.last_step_kind if engine.steps_completed > completed else None
                    self._send_step(outputs, kind)
                    self.gc.on_busy()
        except BaseException as e:
            logger.exception("the engine failed")
            for index in list(self.outs.sockets):
                self.outs.send(index, ["failed", f"{type(e).__name__}: {e}"])
            return 1

    def _take(self, block: bool, timeout: Optional[float] = None) -> list:
        messages = []
        if block:
            try:
                messages.append(self.commands.get(timeout=timeout))
            except queue.Empty:  # (a timeout: only while replicas poll between agreements)
                pass
        while True:
            try:
                messages.append(self.commands.get_nowait())
            except queue.Empty:
                return messages

    def _execute(self, message: list) -> bool:
        kind = message[0]
        if kind == "add":
            _, index, request_id, prompt_ids, params, lora = message
            self.adds_seen[index] = self.adds_seen.get(index, 0) + 1  # refused ones too: the server counts all
            try:
                self.engine.add_request(None, params, request_id=request_id, prompt_ids=prompt_ids,
                                        lora_request=lora_from_wire(lora))
            except Exception as e:  # InvalidRequestError: the server validated it, so rare
                self.outs.send(index, ["add_error", request_id, str(e)])
                return False
            self.progress[request_id] = RequestProgress()
        elif kind == "abort":
            _, request_id, sample = message
            self._abort(request_id, sample)
        elif kind == "call":
            _, index, call_id, name, args = message
            self._call(index, call_id, name, args)
        elif kind == "hello":  # another API server (--api-server-count) joins
            index = message[1]
            self.outs.connect(index)
            self.send_ready(index)
            logger.info("API server %d connected", index)
        elif kind == "detach":  # an API server that is going away: what it still runs is aborted
            index = message[1]
            for request_id in [r for r in self.progress if client_of(r) == index]:
                self._abort(request_id, None)
            self.outs.send(index, ["bye"])
            self.outs.drop(index)
            self.adds_seen.pop(index, None)
        elif kind == "shutdown":
            return True
        else:
            raise ValueError(f"unknown message {kind!r} from an API server")
        return False

    def _abort(self, request_id: str, sample) -> None:
        out = self.engine.abort_request(request_id, sample)
        if out is not None and out.finished:
            self.progress.pop(request_id, None)
        self.needs_step = True  # let the engine release runner rows even if it is now idle

    def _call(self, index: int, call_id: int, name: str, args: list) -> None:
        if name not in CALLS:
            self.outs.send(index, ["call_result", call_id, False, ["ValueError", f"unknown engine call {name!r}"]])
            return
        try:
            if name == "add_lora":
                args = [lora_from_wire(args[0])]
            result = getattr(self.engine, name)(*args)
        except Exception as e:
            self.outs.send(index, ["call_result", call_id, False, [type(e).__name__, str(e)]])
            return
        self.outs.send(index, ["call_result", call_id, True, result])
        self.needs_step = True

    def _send_step(self, outputs: list, kind: Optional[str]) -> None:
        """Send each API server the step's news of its requests: the finished ones' final outputs, and
        what is new of the others read from their live state (engine.changed_unfinished)."""
        deltas: dict[int, list] = {index: [] for index in self.outs.sockets}
        states = self.engine.outputs.states
        for request_id, out in [(o.request_id, o) for o in outputs] + [(r, None) for r in
                                                                       self.engine.changed_unfinished]:
            progress = self.progress.get(request_id)
            if progress is None:
                continue  # aborted meanwhile
            delta = output_delta(out, progress) if out is not None else state_delta(states[request_id], progress)
            if out is not None and out.finished:
                del self.progress[request_id]
            target = deltas.get(client_of(request_id))
            if target is not None:
                target.append(delta)
        snapshot, pauses = self.engine.snapshot().to_wire(), self.gc.take_pauses()
        for index, mine in deltas.items():
            self.outs.send(index, ["step", self.engine.steps_completed, kind, mine, snapshot, pauses,
                                   self.adds_seen.get(index, 0)])

    def _shutdown(self) -> None:
        engine = self.engine
        for request_id in list(self.progress):
            engine.abort_request(request_id)
        self.progress.clear()
        for _ in range(1000):
            if not engine.has_unfinished_requests():
                break
            engine.step()
        engine.step()  # releases the runner rows of what was aborted
        engine.close()  # tensor-parallel workers, if any
        self.gc.stop()
        self._send_step([], None)
        for index in list(self.outs.sockets):
            self.outs.send(index, ["bye"])
