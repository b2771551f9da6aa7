"""AsyncLLMEngine: the engine on a thread of its own, fed by many asyncio handlers.

Four kinds of threads take part:

- the event loop, where handlers call `submit`, `abort`, `call` and `stop`;
- a small pool of *prepare* workers: tokenizing, rendering chat templates (the submission's
  PrepareFn) and validating the prompts against the model's limits. None of that needs engine state
  (the tokenizer and the limits never change), so it never runs on the step loop: a long prompt, or
  a huge body that ends in a 400, does not stall the streams of others;
- the engine thread, the only one that touches the (not thread-safe) LLMEngine: adding, aborting,
  stepping. The engine may also be an EngineCoreClient (core_client), which stands in for an
  LLMEngine running in a process of its own (`tokenmill serve`'s default): this thread then sends
  it requests and takes its step messages, and nothing else changes here. Handlers talk to it through a thread-safe queue of typed commands (AddCommand,
  AbortCommand, CallCommand, StopCommand) and get their outputs back through one asyncio queue per
  submission. With no work, it blocks on the command queue (it does not spin). It makes token ids
  and logprob values only (its OutputProcessor does not detokenize);
- the *detokenizing* thread, which takes what the engine thread hands over, in order: for each
  engine request a RequestDetokenizer makes the text, the logprob pieces and finds the stop strings
  (the same code the offline engine runs), then hands each batch to the event loop in a single
  `loop.call_soon_threadsafe` call. When a stop string ends a sample, that sample is final for the
  client at once (its later tokens are dropped) and a StopSampleCommand aborts it in the engine;
  its siblings go on. With no work, it blocks on its queue.

A submission is a *group* of prompts sharing one SamplingParams (the OpenAI completions API takes a
list of prompts); each prompt becomes one engine request with `params.n` sequences. The group is
validated as a whole before anything is queued, so an invalid prompt refuses the whole submission
and is reported to that submission only; the loop keeps serving everyone else.

The waiting bound (`max_waiting`) counts sequences: a submission is admitted only if the engine's
waiting sequences plus its own (prompts x n) stay within the bound (else EngineOverloadedError, which
the server turns into a 503); one larger than the bound itself could never be admitted and is
refused as invalid.
"""

import asyncio
import itertools
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Optional, Protocol, Union

from tokenmill.engine.client import EngineClient
from tokenmill.engine.output_processor import RequestDetokenizer
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.engine_snapshot import EngineSnapshot
from tokenmill.errors import InvalidRequestError, TokenmillError
from tokenmill.logger import init_logger
from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams

logger = init_logger(__name__)

DEFAULT_PREPARE_WORKERS = 4
HEALTH_CHECK_SECONDS = 1.0  # how often an idle engine thread checks the engine (a process of its own may die)


class EngineOverloadedError(TokenmillError):
    """The waiting queue is past its bound; the client should retry later."""


class EngineDeadError(TokenmillError):
    """The engine thread has stopped (shutdown) or failed; no request can be served."""


class RequestAborted(TokenmillError):
    """The submission was aborted (its consumer gave up)."""


def check_encodable(text: str, what: str) -> None:
    """Refuse text that cannot be encoded as UTF-8 (lone surrogates, which JSON's \\ud800 escapes
    can carry): the tokenizer and every response body need UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{what} cannot be encoded as UTF-8: {e.reason} (character "
                                  f"{text[e.start]!r} at position {e.start})") from None


class PromptTools:
    """What a PrepareFn may use, on a prepare worker: the engine's thread-safe, read-only parts
    (its tokenizer and vocabulary), never its scheduler or caches."""

    def __init__(self, engine: EngineClient):
        self._engine = engine

    @property
    def tokenizer(self):
        return self._engine.tokenizer

    def tokenize(self, prompt: Union[str, list[int]], add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt (or checked token ids); raises InvalidRequestError."""
        if isinstance(prompt, str):
            check_encodable(prompt, "the prompt")
        return self._engine.tokenize(prompt, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int]) -> Optional[str]:
        tokenizer = self._engine.tokenizer
        return None if tokenizer is None else tokenizer.decode(ids)


# Runs on a prepare worker; returns, per prompt, (prompt text or None, prompt token ids).
PrepareFn = Callable[[PromptTools], list[tuple[Optional[str], list[int]]]]


class EngineObserver(Protocol):
    """Receives, on the engine thread, what the server's metrics record. Must be cheap and
    thread-safe."""

    def first_token(self, seconds: float) -> None:
        """Time from arrival to the first token, once per engine request."""

    def inter_token(self, seconds: float) -> None:
        """Time between successive tokens of a sample, once per later token."""

    def step_interval(self, kind: str, seconds: float) -> None:
        """Time between two engine steps while busy, by the kind of step whose results came back."""

    def finished(self, output: RequestOutput, seconds: float) -> None:
        """An engine request ended (aborted ones included), `seconds` after its arrival."""

    def engine_gc_pause(self, generation: int, seconds: float) -> None:
        """A garbage collection in the engine process (one of its own) took `seconds`."""


@dataclass
class PromptInfo:
    text: Optional[str]
    token_ids: list[int]


@dataclass
class ServerStats(EngineSnapshot):
    """A snapshot the engine thread publishes after every step; safe to read from any thread: the
    engine's counters (EngineSnapshot) and the front end's own."""

    num_active_groups: int = 0  # submissions not yet finished
    num_steps: int = 0  # engine steps whose results came back


class RequestStream:
    """What one submission gets back: first the accepted prompts (or the error that refused them),
    then (prompt index, RequestOutput) pairs until every prompt's request has finished.

    Used on the event loop only. Call `abort()` when the consumer gives up: idempotent, and free
    once the stream has finished.
    """

    def __init__(self, engine: "AsyncLLMEngine", request_id: str, params: Optional[SamplingParams] = None):
        self.request_id = request_id
        self.params = params
        self._engine = engine
        self._texts: dict[int, RequestDetokenizer] = {}  # by prompt index; the detokenizing thread's
        self._queue: asyncio.Queue = asyncio.Queue()
        self._remaining: Optional[int] = None
        self.aborted = False
        self.prompts: list[PromptInfo] = []
        self.finished = False  # every output (or an error) has been read

    async def accepted(self) -> list[PromptInfo]:
        """Wait until the prompts are validated and queued; raises the error that refused them
        (InvalidRequestError, EngineOverloadedError, EngineDeadError)."""
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.prompts = item
        self._remaining = len(item)
        return item

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if self.finished:
            raise StopAsyncIteration
        if self._remaining is None:
            await self.accepted()
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item[1].finished:
            self._remaining -= 1
            if self._remaining == 0:
                self.finished = True
        return item

    def fail(self, error: BaseException) -> None:
        """Make the consumer's next read raise `error` (e.g. when its client disconnected)."""
        self._queue.put_nowait(error)

    def abort(self) -> None:
        if not self.finished and not self.aborted:
            self.aborted = True
            self._engine.abort(self.request_id)
            self._queue.put_nowait(RequestAborted(f"request {self.request_id} was aborted"))


# ---- commands to the engine thread -----------------------------------------------------------
@dataclass
class AddCommand:
    """Queue a prepared, validated submission."""

    stream: RequestStream
    prompts: list[PromptInfo]
    params: SamplingParams
    arrival: float
    lora_request: Optional[LoRARequest] = None


@dataclass
class AbortCommand:
    request_id: str


@dataclass
class CallCommand:
    """Run fn(engine) between steps; its result (or error) goes to `future`."""

    fn: Callable[[EngineClient], Any]
    future: asyncio.Future


@dataclass
class StopSampleCommand:
    """A stop string ended one sample (the detokenizing thread found it): abort that sample; the
    client has its final output already."""

    request_id: str  # the engine request
    index: int  # which of its n samples
    stop_reason: str
    num_tokens: int  # the tokens the client got


@dataclass
class StopCommand:
    """Abort everything and end the engine thread."""


Command = Union[AddCommand, AbortCommand, CallCommand, StopSampleCommand, StopCommand]


@dataclass
class _Group:
    """Engine-thread bookkeeping of one submission."""

    stream: RequestStream
    sub_ids: list[str]
    arrival: float
    remaining: int
    # per engine request: per sample [tokens seen, time of the last one]; and whether TTFT was observed
    progress: dict[str, list[list[float]]] = field(default_factory=dict)
    first_seen: set = field(default_factory=set)
    # per engine request: the samples a stop string ended, index -> (stop string, tokens shown)
    text_stops: dict[str, dict[int, tuple[str, int]]] = field(default_factory=dict)


class AsyncLLMEngine:
    """Drive an LLMEngine from asyncio code; `observer` (optional) gets the engine thread's
    latency observations (see EngineObserver)."""

    def __init__(self, engine: EngineClient, *, max_waiting: Optional[int] = None,
                 observer: Optional[EngineObserver] = None, prepare_workers: int = DEFAULT_PREPARE_WORKERS):
        self.engine = engine
        self.max_waiting = max_waiting if max_waiting and max_waiting > 0 else None
        self.observer = observer
        # Facts about the model that never change, readable from any thread.
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.has_tokenizer = engine.tokenizer is not None
        self._tools = PromptTools(engine)
        self._tokenizer = engine.tokenizer
        engine.outputs.detokenize = False  # text is made on the detokenizing thread
        self._prepare_pool = ThreadPoolExecutor(max_workers=prepare_workers, thread_name_prefix="tokenmill-prepare")
        self._preparing: set[asyncio.Task] = set()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._detok_queue: queue.SimpleQueue = queue.SimpleQueue()  # batches of deliveries; None ends it
        self._detok_thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._ids = itertools.count()
        self._stopping = False
        self.error: Optional[BaseException] = None  # set if the engine thread died (or while it restarts the engine)
        self._restarting = False
        # Engine-thread state.
        self._groups: dict[str, _Group] = {}
        self._group_of: dict[str, tuple[str, int]] = {}  # engine request id -> (group id, prompt index)
        self._deliveries: list[tuple[Any, Any]] = []  # (RequestStream or call future, item)
        self._needs_step = False
        self._last_step_end: Optional[float] = None
        self._stats = self._snapshot()

    # ---- lifecycle (event loop side) -------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the outputs."""
        if self._thread is not None:
            raise RuntimeError("the engine is already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._detok_thread = threading.Thread(target=self._run_detokenizer, name="tokenmill-detokenize",
                                              daemon=True)
        self._detok_thread.start()
        self._thread.start()

    async def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever is still running and stop the engine thread."""
        if self._thread is None:
            return
        if not self._stopping:
            self._stopping = True
            self._commands.put(StopCommand())
            self._prepare_pool.shutdown(wait=False)  # what is being prepared is refused when done
        await asyncio.to_thread(self._thread.join, timeout)
        if self._thread.is_alive():
            logger.warning("the engine thread did not stop within %.0f s", timeout)
            return
        self._detok_queue.put(None)  # after the engine thread's last batch
        await asyncio.to_thread(self._detok_thread.join, timeout)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None and not self._stopping

    @property
    def stats(self) -> ServerStats:
        return self._stats

    # ---- requests (event loop side) ----------------------------------------------------------
    def submit(self, prepare: PrepareFn, params: SamplingParams, request_id: Optional[str] = None,
               lora_request: Optional[LoRARequest] = None) -> RequestStream:
        """Prepare a submission on a worker, then queue it; `await stream.accepted()` to learn
        whether it was taken (every prompt runs with `lora_request`'s adapter if given). Call from
        the event loop."""
        stream = RequestStream(self, request_id or f"req-{next(self._ids)}", params)
        if not self.is_running:
            stream.fail(self._dead_error())
            return stream
        task = self._loop.create_task(self._prepare_and_add(stream, prepare, params, time.monotonic(), lora_request))
        self._preparing.add(task)
        task.add_done_callback(self._preparing.discard)
        return stream

    async def _prepare_and_add(self, stream: RequestStream, prepare: PrepareFn, params: SamplingParams,
                               arrival: float, lora_request: Optional[LoRARequest] = None) -> None:
        if not self.is_running:  # stop() shuts the pool down (on this loop, so not between here and there)
            stream.fail(self._dead_error())
            return
        try:
            prompts = await self._loop.run_in_executor(self._prepare_pool, self._prepare, prepare, params)
        except InvalidRequestError as e:
            stream.fail(e)
            return
        except Exception as e:  # a tokenizer or template failing on odd input in a way of its own
            logger.warning("request %s could not be prepared: %r", stream.request_id, e)
            logger.debug("preparing request %s failed", stream.request_id, exc_info=True)
            stream.fail(InvalidRequestError(f"the request could not be processed: {type(e).__name__}: {e}"))
            return
        if stream.aborted:
            return  # its consumer gave up while it was being prepared
        if not self.is_running:
            stream.fail(self._dead_error())
            return
        self._commands.put(AddCommand(stream, prompts, params, arrival, lora_request))
        if not self._thread.is_alive():  # it ended meanwhile and may not have seen the command
            stream.fail(self._dead_error())

    def _prepare(self, prepare: PrepareFn, params: SamplingParams) -> list[PromptInfo]:
        """On a prepare worker: tokenize/render, then every check that needs no engine state."""
        prompts = [PromptInfo(text, list(ids)) for text, ids in prepare(self._tools)]
        if not prompts:
            raise InvalidRequestError("no prompt was given")
        sequences = len(prompts) * params.n
        if self.max_waiting is not None and sequences > self.max_waiting:
            raise InvalidRequestError(
                f"the request has {sequences} sequences ({len(prompts)} prompt(s) x n={params.n}), more than "
                f"the {self.max_waiting} the server lets wait at once (max_waiting); send fewer per request")
        for prompt in prompts:  # validate everything before queueing anything
            self.engine.validate(prompt.token_ids, params)  # reads only the model's fixed limits
        return prompts

    async def call(self, fn: Callable[[EngineClient], Any]) -> Any:
        """Run fn(engine) on the engine thread, between steps; returns its result or raises its error."""
        if not self.is_running:
            raise self._dead_error()
        future = self._loop.create_future()
        self._commands.put(CallCommand(fn, future))
        if not self._thread.is_alive():
            raise self._dead_error()
        return await future

    def abort(self, request_id: str) -> None:
        """Abort a submission (all its prompts); its KV blocks go back to the pool. Thread-safe."""
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(AbortCommand(request_id))

    def _dead_error(self) -> EngineDeadError:
        if self._restarting:
            return EngineDeadError(f"the engine is restarting after a failure: {self.error}")
        if isinstance(self.error, EngineDeadError):
            return EngineDeadError(str(self.error))
        if self.error is not None:
            return EngineDeadError(f"the engine has failed: {self.error!r}")
        return EngineDeadError("the server is shutting down")

    # ---- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        while not self._serve():  # the engine failed but was restarted (an engine process: core_client)
            pass

    def _serve(self) -> bool:
        """Run the loop until a stop (True) or a failure of the engine: every open stream is failed
        then; with an engine that can restart (its process died) it restarts (False: serve again),
        else the thread ends with `error` set (True)."""
        engine = self.engine
        try:
            while True:
                idle = not engine.has_unfinished_requests() and not self._needs_step
                stop = False
                for command in self._take_commands(block=idle):
                    stop = self._execute(command) or stop
                if stop:
                    self._shutdown()
                    return True
                if engine.has_unfinished_requests() or self._needs_step:
                    self._needs_step = False
                    completed = engine.steps_completed
                    outputs = engine.step()
                    self._observe_step(engine.last_step_kind if engine.steps_completed > completed else None)
                    self._dispatch(outputs)
                    if self.observer is not None:
                        for generation, seconds in engine.take_gc_pauses():
                            self.observer.engine_gc_pause(generation, seconds)
                else:
                    self._last_step_end = None  # idle: the next interval starts afresh
                self._stats = self._snapshot()
                self._flush()
        except BaseException as e:  # a bug in the engine, or its process died: fail everyone, loudly
            if isinstance(e, EngineDeadError):
                logger.error("the engine is gone: %s", e)
            else:
                logger.exception("the engine thread failed")
            self.error = e
            for group in self._groups.values():
                self._deliveries.append((group.stream, self._dead_error()))
            self._groups.clear()
            self._group_of.clear()
            restart = getattr(engine, "restart", None)
            if isinstance(e, EngineDeadError) and callable(restart) and not self._stopping:
                self._restarting = True  # new submissions are refused meanwhile (503), /health says 503
                self._flush()  # the failed streams hear it now, not after the restart
                try:
                    restart()
                except BaseException as again:
                    self.error = again
                else:
                    self.error = None
                    return False
                finally:
                    self._restarting = False
                    self._needs_step = False
                    self._last_step_end = None
                    self._stats = self._snapshot()
            self._refuse_queued(self._dead_error())
            self._flush()
            return True

    def _execute(self, command: Command) -> bool:
        """Carry out one command; True if it asks the thread to stop."""
        match command:
            case AddCommand():
                self._add(command)
            case AbortCommand(request_id=request_id):
                self._abort(request_id)
            case CallCommand():
                self._call(command)
            case StopSampleCommand():
                self._stop_sample(command)
            case StopCommand():
                return True
            case _:
                raise TypeError(f"unknown engine command {command!r}")
        return False

    def _refuse_queued(self, error: EngineDeadError) -> None:
        """Answer the submissions and calls still queued (the thread is about to end)."""
        for command in self._take_commands(block=False):
            if isinstance(command, AddCommand):
                self._deliveries.append((command.stream, error))
            elif isinstance(command, CallCommand):
                self._deliveries.append((command.future, error))

    def _take_commands(self, block: bool) -> list[Command]:
        commands = []
        while block and not commands:  # idle: wait, looking at the engine's health now and then
            try:
                commands.append(self._commands.get(timeout=HEALTH_CHECK_SECONDS))
            except queue.Empty:
                self.engine.check_health()
                self._stats = self._snapshot()  # an engine process may have sent its last counters since
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _add(self, command: AddCommand) -> None:
        engine, stream, params = self.engine, command.stream, command.params
        single = len(command.prompts) == 1
        sub_ids = [stream.request_id if single else f"{stream.request_id}-{i}" for i in range(len(command.prompts))]
        added: list[str] = []
        try:
            if stream.request_id in self._groups:
                raise InvalidRequestError(f"request id {stream.request_id!r} is in use")
            self._check_waiting(len(sub_ids) * params.n)
            for sub_id, prompt in zip(sub_ids, command.prompts):
                engine.add_request(prompt.text, params, request_id=sub_id, prompt_ids=prompt.token_ids,
                                   lora_request=command.lora_request)
                added.append(sub_id)
        except Exception as e:  # InvalidRequestError, EngineOverloadedError; anything else is a bug
            for sub_id in added:
                engine.abort_request(sub_id)
            self._needs_step = self._needs_step or bool(added)
            self._deliveries.append((stream, e))
            return
        group = _Group(stream, sub_ids, command.arrival, len(sub_ids))
        self._groups[stream.request_id] = group
        for i, sub_id in enumerate(sub_ids):
            self._group_of[sub_id] = (stream.request_id, i)
            group.progress[sub_id] = [[0, command.arrival] for _ in range(params.n)]
        self._deliveries.append((stream, command.prompts))

    def _check_waiting(self, sequences: int) -> None:
        if self.max_waiting is None:
            return
        waiting = self.engine.num_waiting_sequences()
        if waiting + sequences > self.max_waiting:
            raise EngineOverloadedError(
                f"the server is overloaded ({waiting} sequences waiting, at most {self.max_waiting}; this request "
                f"adds {sequences}); retry later")

    def _call(self, command: CallCommand) -> None:
        try:
            result = command.fn(self.engine)
        except Exception as e:
            result = e
        self._deliveries.append((command.future, result))
        self._needs_step = True

    def _abort(self, request_id: str) -> None:
        group = self._groups.pop(request_id, None)
        if group is None:
            return  # finished already, or never accepted
        now = time.monotonic()
        for sub_id in group.sub_ids:
            if self._group_of.pop(sub_id, None) is None:
                continue  # this prompt had finished
            out = self.engine.abort_request(sub_id)
            if out is not None and self.observer is not None:
                self.observer.finished(_as_shown(group, out), now - group.arrival)
        self._needs_step = True  # let the engine release runner rows even if it is now idle

    def _stop_sample(self, command: StopSampleCommand) -> None:
        where = self._group_of.get(command.request_id)
        if where is None:
            return  # finished or aborted meanwhile
        group = self._groups[where[0]]
        group.text_stops.setdefault(command.request_id, {})[command.index] = (command.stop_reason,
                                                                              command.num_tokens)
        out = self.engine.abort_request(command.request_id, sample=command.index)
        self._needs_step = True  # let the engine release runner rows even if it is now idle
        if out is not None and out.finished:
            self._dispatch([out])

    def _observe_step(self, kind: Optional[str]) -> None:
        """The interval between two engine steps in a busy loop, by the kind of the step whose
        results just came back (kind None: none did). With async scheduling that interval is the
        device time of that step, or the CPU's if the CPU is the slower."""
        now = time.monotonic()
        last, self._last_step_end = self._last_step_end, now
        if self.observer is not None and last is not None and kind is not None:
            self.observer.step_interval(kind, now - last)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            where = self._group_of.get(out.request_id)
            if where is None:
                continue  # aborted meanwhile
            group = self._groups[where[0]]
            if self.observer is not None:
                self._observe_tokens(self.observer, group, out, now)
            self._deliveries.append((group.stream, where[1:] + (out,)))
            if out.finished:
                del self._group_of[out.request_id]
                group.remaining -= 1
                if self.observer is not None:
                    self.observer.finished(_as_shown(group, out), now - group.arrival)
                if group.remaining == 0:
                    del self._groups[where[0]]

    @staticmethod
    def _observe_tokens(observer: EngineObserver, group: _Group, out: RequestOutput, now: float) -> None:
        """Time to first token (once per engine request) and inter-token latencies of new tokens."""
        progress = group.progress[out.request_id]
        for c in out.outputs:
            seen = progress[c.index]
            new = len(c.token_ids) - seen[0]
            if new <= 0:
                continue
            if seen[0] == 0 and out.request_id not in group.first_seen:
                group.first_seen.add(out.request_id)
                observer.first_token(now - group.arrival)
            elif seen[0] > 0:
                gap = (now - seen[1]) / new
                for _ in range(new):
                    observer.inter_token(gap)
            seen[0], seen[1] = len(c.token_ids), now

    def _shutdown(self) -> None:
        for request_id in list(self._groups):
            stream = self._groups[request_id].stream
            self._abort(request_id)
            self._deliveries.append((stream, EngineDeadError("the server is shutting down")))
        self._refuse_queued(EngineDeadError("the server is shutting down"))  # anything behind the stop
        for _ in range(1000):
            if not self.engine.has_unfinished_requests():
                break
            self.engine.step()
        self.engine.step()  # releases the runner rows of what was aborted
        self._stats = self._snapshot()
        self._flush()

    def _snapshot(self) -> ServerStats:
        s = self.engine.snapshot()
        return ServerStats(**{f.name: getattr(s, f.name) for f in fields(EngineSnapshot)},
                           num_active_groups=len(self._groups), num_steps=self.engine.steps_completed)

    def _flush(self) -> None:
        if not self._deliveries:
            return
        batch, self._deliveries = self._deliveries, []
        self._detok_queue.put(batch)

    # ---- the detokenizing thread -------------------------------------------------------------
    def _run_detokenizer(self) -> None:
        """Take the engine thread's batches in order (all that are waiting at once), give the outputs
        their text, and hand them to the event loop."""
        while True:
            batches = [self._detok_queue.get()]
            while True:
                try:
                    batches.append(self._detok_queue.get_nowait())
                except queue.Empty:
                    break
            ready: list[tuple[Any, Any]] = []
            for batch in batches:
                if batch is not None:
                    ready.extend(self._with_text(batch))
            if ready:
                try:
                    self._loop.call_soon_threadsafe(_deliver, ready)
                except RuntimeError:  # the event loop is closed: nobody is listening any more
                    pass
            if None in batches:
                return

    def _with_text(self, batch: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
        if self._tokenizer is None:
            return batch  # no text to make (and no stop strings)
        ready = []
        for target, item in batch:
            if isinstance(target, RequestStream) and isinstance(item, tuple):
                try:
                    item = self._shown(target, *item)
                except Exception as e:  # a bug, or a tokenizer failing in a way of its own
                    logger.exception("detokenizing the output of request %s failed", target.request_id)
                    item = TokenmillError(f"the output could not be detokenized: {type(e).__name__}: {e}")
                    self.abort(target.request_id)
                if item is None:
                    continue
            ready.append((target, item))
        return ready

    def _shown(self, stream: RequestStream, index: int, out: RequestOutput) -> Optional[tuple[int, RequestOutput]]:
        """One engine output as the client sees it (None: nothing more to show for that request);
        the samples a stop string ended are aborted in the engine."""
        state = stream._texts.get(index)
        if state is None:
            state = stream._texts[index] = RequestDetokenizer(self._tokenizer, out.prompt_token_ids, stream.params)
        shown, stopped = state.process(out)
        for sample in stopped:
            c = shown.outputs[sample]
            self._commands.put(StopSampleCommand(out.request_id, sample, c.stop_reason, len(c.token_ids)))
        return None if shown is None else (index, shown)


def _as_shown(group: _Group, out: RequestOutput) -> RequestOutput:
    """An engine output as its client saw it: the samples a stop string ended stop there."""
    stops = group.text_stops.get(out.request_id)
    if not stops:
        return out
    outputs = [replace(c, finish_reason="stop", stop_reason=stops[c.index][0],
                       token_ids=c.token_ids[:stops[c.index][1]]) if c.index in stops else c
               for c in out.outputs]
    return replace(out, outputs=outputs)


def _deliver(batch: list[tuple[Any, Any]]) -> None:
    for target, item in batch:
        if isinstance(target, RequestStream):
            target._queue.put_nowait(item)
        elif not target.done():  # a call's future
            if isinstance(item, BaseException):
                target.set_exception(item)
            else:
                target.set_result(item)
