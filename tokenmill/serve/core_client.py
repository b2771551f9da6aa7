"""The engine process seen from the API server: EngineCoreClient starts it and stands in for the
LLMEngine that AsyncLLMEngine drives.

The API server process tokenizes, renders chat templates, validates, detokenizes and streams; the
engine process (core_process) schedules and runs the model. Between them, two ZeroMQ sockets over
Unix-domain (ipc) paths carry compact msgpack messages (core_messages): requests and aborts one way,
one message per engine step the other.

AsyncLLMEngine's engine thread becomes the client's thread: `add_request` / `abort_request` send at
once; `step()` takes the next step message (waiting for it a short while at most, so that new
commands are not held up) and turns its deltas back into RequestOutputs, the same cumulative
outputs the in-process engine returns; the text is made on the detokenizing thread as before.
Validation needs no engine state, so it runs here (RequestValidator over the engine's facts, with a
grammar compiler of its own), and an invalid request never reaches the engine process.

A dead engine process (killed, crashed, or failed with an error) turns into EngineDeadError on the
next `step()` or `check_health()`: AsyncLLMEngine then fails every open stream at once and calls
`restart()`. API server 0 (the owner) starts a new engine process in the same place, after a
backoff of RESTART_BACKOFF_S doubling with each restart, at most `max_restarts` times over the
server's life, each logged, and loads again the LoRA adapters the engine had; `engine_restarts`
counts them (/metrics). When no restart is left, `restart()` tells `on_give_up` (the server then
exits with status 1, for its supervisor to restart it) and raises.
"""

import multiprocessing
import os
import pickle
import shutil
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import count
from typing import Callable, Optional

from tokenmill.serve.async_engine import EngineDeadError
from tokenmill.serve.core_wire import (EngineFacts, EngineSnapshot, logprobs_from_wire, lora_to_wire, pack,
                                            params_to_wire, prompt_logprobs_from_wire, unpack)
from tokenmill.serve.core_process import EngineLaunch, addresses, run_engine_process
from tokenmill.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.engine.request_validator import RequestValidator
from tokenmill.engine.grammar import StructuredOutputManager
from tokenmill.errors import InvalidRequestError, LoRAError
from tokenmill.logger import init_logger
from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams

logger = init_logger(__name__)

STEP_WAIT_S = 0.02  # step() waits at most this long for a message, then lets commands in
STARTUP_TIMEOUT_S = 3600.0  # loading a large model from a slow disk
STOP_TIMEOUT_S = 30.0
RESTART_BACKOFF_S = 0.5  # before the first restart of a dead engine process; doubles with each


class EngineProcessError(EngineDeadError):
    """The engine process failed, exited or could not start."""


@dataclass
class _Sample:
    token_ids: list = field(default_factory=list)
    logprobs: Optional[list] = None
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None
    stop_reason: object = None


@dataclass
class _Live:
    """A request in the engine process, as far as its step messages have told."""

    prompt: Optional[str]
    prompt_token_ids: list
    samples: list
    arrival: float
    num_cached: int = 0
    num_host_cached: int = 0  # of num_cached, loaded from the host tier
    prompt_logprobs: Optional[list] = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def output(self, request_id: str) -> RequestOutput:
        outputs = [CompletionOutput(i, "", list(s.token_ids), s.cumulative_logprob,
                                    None if s.logprobs is None else list(s.logprobs), s.finish_reason,
                                    s.stop_reason) for i, s in enumerate(self.samples)]
        return RequestOutput(request_id, self.prompt, self.prompt_token_ids, outputs, self.finished,
                             RequestMetrics(self.arrival, num_cached_prompt_tokens=self.num_cached,
                                            num_host_cached_prompt_tokens=self.num_host_cached),
                             self.prompt_logprobs)


class _OutputSwitch:
    """AsyncLLMEngine turns detokenization off on the engine it drives; the engine process has it
    off already (the text is made here)."""

    detokenize = False


# Errors of an engine call that are the caller's to act on, raised again as themselves.
_USER_ERRORS = {"LoRAError": LoRAError, "InvalidRequestError": InvalidRequestError}


class EngineCoreClient:
    """API server `index`'s side of the engine process. `EngineCoreClient.launch(...)` starts the
    engine process (as server 0, which owns it: it alone shuts it down); servers 1..N-1 of
    `--api-server-count` connect to the running engine with `EngineCoreClient(engine_dir, index,
    engine_pid=...)`."""

    @classmethod
    def launch(cls, launch: EngineLaunch, startup_timeout: float = STARTUP_TIMEOUT_S,
               max_restarts: int = 0) -> "EngineCoreClient":
        return cls(tempfile.mkdtemp(prefix="tokenmill-engine-"), 0, launch=launch, startup_timeout=startup_timeout,
                   max_restarts=max_restarts)

    def __init__(self, engine_dir: str, index: int, *, launch: Optional[EngineLaunch] = None,
                 engine_pid: Optional[int] = None, startup_timeout: float = STARTUP_TIMEOUT_S,
                 max_restarts: int = 0):
        import zmq

        self._zmq = zmq
        self._dir = engine_dir
        self.index = index
        self._owner = launch is not None
        self._launch = launch
        self._startup_timeout = startup_timeout
        self.max_restarts = max_restarts if self._owner else 0  # only the owner can start an engine process
        self.engine_restarts = 0
        self.on_give_up: Optional[Callable[[str], None]] = None  # told why, when a dead engine stays dead
        self._loras: dict[int, LoRARequest] = {}  # the adapters the engine has: loaded again after a restart
        self._steps_base = 0  # the steps of the engine processes before this one
        self._ctx = zmq.Context(io_threads=1)
        out_addr = addresses(engine_dir, index)[1]
        self._out = self._ctx.socket(zmq.PULL)  # from the engine (bound first: the engine connects to it)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.bind(out_addr)
        self._connect_in()
        self._poller = zmq.Poller()
        self._poller.register(self._out, zmq.POLLIN)
        self._proc = None
        if self._owner:
            self._start_process()
            engine_pid = self._proc.pid
        else:
            self._in.send(pack(["hello", index]))
        self.pid = engine_pid
        self._closed = False
        self.error: Optional[str] = None
        try:
            facts = self._wait_ready(startup_timeout)
        except BaseException:
            self.close(timeout=5.0)
            raise
        self.facts = facts
        self.tokenizer = pickle.loads(facts.tokenizer) if facts.tokenizer is not None else None
        self.model_name = facts.model_name
        self.max_model_len = facts.max_model_len
        self.vocab_size = facts.vocab_size
        self.summary = facts.summary
        self.structured = StructuredOutputManager(self.tokenizer, facts.vocab_size, list(facts.eos_token_ids))
        self.validator = RequestValidator(self.tokenizer, facts.vocab_size, facts.max_model_len, facts.num_blocks,
                                          facts.block_size, self.structured)
        self.outputs = _OutputSwitch()
        self._live: dict[str, _Live] = {}
        self._snapshot = (EngineSnapshot.from_wire(facts.snapshot) if facts.snapshot is not None
                          else EngineSnapshot(num_blocks=facts.num_blocks, num_free_blocks=facts.num_blocks))
        self._gc_pauses: list[tuple[int, float]] = []
        self._calls = count()
        self._results: dict[int, tuple[bool, object]] = {}
        self._unseen_adds: deque[int] = deque()  # n of each add the engine had not taken at its last step
        self._adds_taken = 0  # adds the engine has carried out
        self._backlog: list[RequestOutput] = []  # outputs that came while waiting for a call's result
        self.steps_completed = 0
        self.last_step_kind: Optional[str] = None
        logger.info("engine process %d ready (%s)", self.pid, facts.summary)

    @property
    def engine_dir(self) -> str:
        return self._dir

    # ---- start-up and shutdown -------------------------------------------------------------
    def _connect_in(self) -> None:
        self._in = self._ctx.socket(self._zmq.PUSH)  # to the engine
        self._in.setsockopt(self._zmq.LINGER, 1000)
        self._in.connect(addresses(self._dir, self.index)[0])

    def _start_process(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._proc = ctx.Process(target=run_engine_process, args=(self._launch, self._dir, os.getpid()),
                                 name="tokenmill-engine", daemon=False)
        self._proc.start()

    def _engine_exit(self) -> Optional[str]:
        """Why the engine process is gone, or None while it runs."""
        if self._proc is not None:
            code = self._proc.exitcode
            if code is None:
                return None
            why = f"the engine process {self.pid} exited with code {code}"
            return why + (f" (killed by signal {-code})" if code < 0 else "")
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                state = f.read().rsplit(") ", 1)[1][0]
        except OSError:
            state = None
        return None if state not in (None, "Z", "X") else f"the engine process {self.pid} is gone"

    def _wait_ready(self, timeout: float) -> EngineFacts:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._poller.poll(200):
                message = unpack(self._out.recv())
                if message[0] == "ready":
                    return EngineFacts(**message[1])
                if message[0] == "failed":
                    raise EngineProcessError(message[1])
            else:
                gone = self._engine_exit()
                if gone is not None:
                    raise EngineProcessError(f"{gone} while starting (its log above says why)")
        raise EngineProcessError(f"the engine process was not ready within {timeout:.0f} s")

    def close(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Server 0: stop the engine process (what still runs there is aborted) and wait for it to
        end. Other servers: detach (their requests are aborted there)."""
        if self._closed:
            return
        self._closed = True
        if self._engine_exit() is None:
            try:
                self._in.send(pack(["shutdown"] if self._owner else ["detach", self.index]),
                              flags=self._zmq.NOBLOCK)
            except self._zmq.ZMQError:
                pass
            deadline = time.monotonic() + timeout
            while self._engine_exit() is None and time.monotonic() < deadline:
                if self._poller.poll(100):
                    if unpack(self._out.recv())[0] == "bye" and not self._owner:
                        break
            if self._owner and self._proc.exitcode is None:
                logger.warning("the engine process %d did not stop within %.0f s; killing it", self.pid, timeout)
                self._proc.kill()
        if self._proc is not None:
            self._proc.join(5.0)
        self._in.close()
        self._out.close()
        self._ctx.term()
        if self._owner:
            shutil.rmtree(self._dir, ignore_errors=True)

    def restart(self) -> None:
        """Start a new engine process in place of the dead one (API server 0 only), after a backoff;
        what ran in the dead one is dropped (its streams were failed already). Raises
        EngineProcessError, after telling on_give_up, when no restart is left."""
        why = self.error or self._engine_exit() or "the engine process failed"
        while self.engine_restarts < self.max_restarts:
            delay = RESTART_BACKOFF_S * 2 ** self.engine_restarts
            self.engine_restarts += 1
            logger.warning("%s: restarting the engine process in %.1f s (restart %d of at most %d)", why, delay,
                           self.engine_restarts, self.max_restarts)
            time.sleep(delay)
            try:
                self._respawn()
                logger.warning("engine process %d ready after restart %d of at most %d", self.pid,
                               self.engine_restarts, self.max_restarts)
                return
            except EngineProcessError as e:
                why = str(e)
                logger.error("restart %d of the engine process failed: %s", self.engine_restarts, why)
        if not self._owner:
            why += " (only the first API server process restarts it)"
        elif self.max_restarts:
            why += f" (after {self.engine_restarts} restart(s), the most --max-engine-restarts allows)"
        self.error = why
        logger.error("the engine process is not restarted: %s", why)
        if self.on_give_up is not None:
            self.on_give_up(why)
        raise EngineProcessError(why)

    def _respawn(self) -> None:
        if self._proc is not None and self._proc.exitcode is None:  # failed but still ending
            self._proc.kill()
        if self._proc is not None:
            self._proc.join(5.0)
        self._in.close(linger=0)  # what was sent to the dead engine is not for the new one
        self._connect_in()
        while self._poller.poll(0):  # nor is what the dead one had sent
            self._out.recv()
        self.error = None
        self._live.clear()
        self._unseen_adds.clear()
        self._adds_taken = 0
        self._results.clear()
        self._backlog = []
        self._steps_base = self.steps_completed
        self._start_process()
        self.pid = self._proc.pid
        try:
            facts = self._wait_ready(self._startup_timeout)
            self._snapshot = (EngineSnapshot.from_wire(facts.snapshot) if facts.snapshot is not None
                              else EngineSnapshot(num_blocks=facts.num_blocks, num_free_blocks=facts.num_blocks))
            for lora in self._loras.values():
                self._call("add_lora", [lora_to_wire(lora)])
        except BaseException as e:
            if self._proc.exitcode is None:
                self._proc.kill()
                self._proc.join(5.0)
            if isinstance(e, EngineProcessError):
                raise
            raise EngineProcessError(f"the new engine process failed: {type(e).__name__}: {e}") from e

    def check_health(self) -> None:
        """Raise EngineProcessError if the engine process has ended or failed. Also takes the
        messages that came meanwhile (an idle engine's last counters, after an abort)."""
        while self.error is None and self._poller.poll(0):
            outputs = self._handle(unpack(self._out.recv()))
            if outputs:
                self._backlog.extend(outputs)
        if self.error is not None:
            raise EngineProcessError(self.error)
        gone = self._engine_exit()
        if gone is not None:
            self.error = gone
            logger.error("%s", self.error)
            raise EngineProcessError(self.error)

    # ---- what AsyncLLMEngine drives ------------------------------------------------------------
    def tokenize(self, prompt, add_special_tokens: bool = True) -> list[int]:
        return self.validator.tokenize(prompt, add_special_tokens)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> int:
        return self.validator.validate(prompt_ids, params)

    def add_request(self, prompt, params: SamplingParams, request_id: str, prompt_ids: list[int],
                    lora_request: Optional[LoRARequest] = None) -> str:
        """Send a validated request to the engine process (with an adapter the engine has: the API
        server adds adapters through add_lora first)."""
        if request_id in self._live:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self.check_health()
        wants_logprobs = params.logprobs is not None
        samples = [_Sample(logprobs=[] if wants_logprobs else None, cumulative_logprob=0.0 if wants_logprobs else None)
                   for _ in range(params.n)]
        self._live[request_id] = _Live(prompt if isinstance(prompt, str) else None, list(prompt_ids), samples,
                                       time.monotonic(), prompt_logprobs=None)
        self._in.send(pack(["add", self.index, f"{self.index}/{request_id}", list(prompt_ids),
                            params_to_wire(params), lora_to_wire(lora_request)]))
        self._unseen_adds.append(params.n)
        return request_id

    def abort_request(self, request_id: str, sample: Optional[int] = None) -> Optional[RequestOutput]:
        """Abort a request (or one of its samples) there; its output as it stands, marked aborted,
        comes back at once (final once every sample has ended)."""
        live = self._live.get(request_id)
        if live is None:
            return None
        for s in live.samples if sample is None else live.samples[sample:sample + 1]:
            if s.finish_reason is None:
                s.finish_reason = "abort"
        if self.error is None:
            self._in.send(pack(["abort", f"{self.index}/{request_id}", sample]))
        out = live.output(request_id)
        if out.finished:
            del self._live[request_id]
        return out

    def has_unfinished_requests(self) -> bool:
        # Outputs that check_health() or _call() took between steps count: the last request's final
        # output may be among them, and an engine thread told "nothing unfinished" would never step it out.
        return bool(self._live) or bool(self._backlog)

    def num_waiting_sequences(self) -> int:
        """What the last step message said waits, plus the sequences sent since that the engine had
        not taken yet (they wait too)."""
        return self._snapshot.num_waiting + sum(self._unseen_adds)

    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    def take_gc_pauses(self) -> list[tuple[int, float]]:
        pauses, self._gc_pauses = self._gc_pauses, []
        return pauses

    def step(self) -> list[RequestOutput]:
        """The outputs of the engine's next step (waits STEP_WAIT_S at most; [] if none came)."""
        if self._backlog:
            outputs, self._backlog = self._backlog, []
            return outputs
        wait_ms = int(STEP_WAIT_S * 1000)  # (with nothing live: the step an abort or a call asked for)
        while True:
            if not self._poller.poll(wait_ms):
                self.check_health()
                return []
            outputs = self._handle(unpack(self._out.recv()))
            if outputs is not None:
                return outputs
            wait_ms = 0

    def reset_prefix_cache(self) -> bool:
        return bool(self._call("reset_prefix_cache"))

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and check an adapter in the engine process; LoRAError (its message) if it is bad."""
        self._call("add_lora", [lora_to_wire(lora_request)])
        self._loras[lora_request.lora_int_id] = lora_request

    def remove_lora(self, lora_int_id: int) -> bool:
        removed = bool(self._call("remove_lora", [int(lora_int_id)]))
        self._loras.pop(int(lora_int_id), None)
        return removed

    def list_loras(self) -> list[int]:
        return list(self._call("list_loras"))

    def _call(self, name: str, args: Optional[list] = None):
        call_id = next(self._calls)
        self._in.send(pack(["call", self.index, call_id, name, list(args or [])]))
        while call_id not in self._results:
            if not self._poller.poll(100):
                self.check_health()
                continue
            outputs = self._handle(unpack(self._out.recv()))
            if outputs:
                self._backlog.extend(outputs)
        ok, result = self._results.pop(call_id)
        if not ok:
            kind, message = result
            if kind in _USER_ERRORS:  # the caller's mistake (a bad adapter): the same error here
                raise _USER_ERRORS[kind](message)
            raise EngineProcessError(f"the engine call {name} failed: {kind}: {message}")
        return result

    # ---- messages from the engine ------------------------------------------------------------------
    def _handle(self, message: list) -> Optional[list[RequestOutput]]:
        """Apply one message; a step message returns its outputs, the others None."""
        kind = message[0]
        if kind == "step":
            _, steps, step_kind, deltas, snapshot, pauses, adds_seen = message
            self.steps_completed, self.last_step_kind = self._steps_base + steps, step_kind
            while self._adds_taken < adds_seen:
                self._unseen_adds.popleft()
                self._adds_taken += 1
            self._snapshot = EngineSnapshot.from_wire(snapshot)
            self._gc_pauses.extend((g, s) for g, s in pauses)
            return [out for out in (self._apply(d) for d in deltas) if out is not None]
        if kind == "add_error":
            _, request_id, error = message
            request_id = request_id.split("/", 1)[1]
            logger.warning("the engine process refused request %s: %s", request_id, error)
            live = self._live.get(request_id)
            if live is not None:
                for s in live.samples:
                    s.finish_reason = s.finish_reason or "abort"
                self._backlog.append(live.output(request_id))
                del self._live[request_id]
            return None
        if kind == "call_result":
            _, call_id, ok, result = message
            self._results[call_id] = (ok, result)
            return None
        if kind == "failed":
            self.error = f"the engine process failed: {message[1]}"
            logger.error("%s", self.error)
            raise EngineProcessError(self.error)
        if kind == "bye":
            return None
        raise EngineProcessError(f"unknown message {kind!r} from the engine process")

    def _apply(self, delta: list) -> Optional[RequestOutput]:
        request_id, finished, cached, prompt_lps, samples = delta
        request_id = request_id.split("/", 1)[1]  # "<this server's index>/<its id>"
        live = self._live.get(request_id)
        if live is None:
            return None  # aborted here meanwhile
        live.num_cached, live.num_host_cached = cached
        if prompt_lps is not None:
            live.prompt_logprobs = prompt_logprobs_from_wire(prompt_lps)
        for index, new_ids, finish_reason, stop_reason, cumulative, new_lps in samples:
            s = live.samples[index]
            if s.finish_reason is not None:
                continue  # ended here (a stop string, an abort): what came after is dropped
            s.token_ids.extend(new_ids)
            if new_lps is not None and s.logprobs is not None:
                s.logprobs.extend(logprobs_from_wire(new_lps))
            s.cumulative_logprob = cumulative
            s.finish_reason, s.stop_reason = finish_reason, stop_reason
        out = live.output(request_id)
        if out.finished:
            del self._live[request_id]
        return out
