"""The OpenAI-compatible HTTP server: the FastAPI app factory and `run_server`.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /tokenize, POST /detokenize,
GET /v1/models(/{id}), GET /health, GET /metrics (Prometheus text), GET /version,
POST /reset_prefix_cache (for benchmarks), POST /v1/load_lora_adapter and POST
/v1/unload_lora_adapter (LoRA adapters served by name: serve/openai/lora.py). The engine
runs on its own thread (AsyncLLMEngine), started and stopped with the app's lifespan. On SIGINT or
SIGTERM uvicorn stops accepting and waits for in-flight requests; after the grace period the engine
is stopped, which aborts what still runs (see Server below); then the process exits 0. A second
SIGINT/SIGTERM aborts what still runs at once, and the process exits 128 + that signal's number
(130 for SIGINT, 143 for SIGTERM), as a shell reports a process ended by that signal.
"""

import asyncio
import contextlib
import gc
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from tokenmill.version import __version__
from tokenmill.config import ConfigError
from tokenmill.serve.gc_policy import GCPolicy
from tokenmill.engine.client import EngineClient
from tokenmill.serve.async_engine import AsyncLLMEngine
from tokenmill.serve.openai.errors import APIError, echoed, install_error_handlers
from tokenmill.serve.openai.lora import LoRAModule, LoRARegistry, LoRARegistryError
from tokenmill.serve.openai.metrics import CONTENT_TYPE, ServerMetrics
from tokenmill.serve.openai.middleware import GuardMiddleware
from tokenmill.serve.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                   ErrorResponse, LoadLoRAAdapterRequest, TokenizeRequest,
                                                   UnloadLoRAAdapterRequest)
from tokenmill.serve.openai.serving_chat import OpenAIServingChat
from tokenmill.serve.openai.serving_common import DEFAULT_MAX_SEQUENCES_PER_REQUEST
from tokenmill.serve.openai.serving_completions import OpenAIServingCompletion
from tokenmill.serve.openai.serving_tokenize import OpenAIServingTokenization
from tokenmill.serve.openai.tenants import Tenants
from tokenmill.serve.openai.tool_parsers import TOOL_PARSERS
from tokenmill.errors import InvalidRequestError, LoRAError
from tokenmill.logger import dump_stacks_on_sigusr1, init_logger

logger = init_logger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 << 20
GC_CHECK_SECONDS = 1.0  # how often the server looks for an idle moment to collect garbage in
FORCED_CLOSE_SECONDS = 2.0  # after a second signal: how long aborted streams get to send their last events


@dataclass
class ServerSettings:
    served_model_names: Optional[list[str]] = None  # default: the engine's model name
    # Keys that open every route but /health (any one of them; none: no key needed). `api_key` is
    # one more, for callers with a single key. serve/openai/tenants.py has what the next three decide.
    api_key: Optional[str] = None
    api_keys: list[str] = field(default_factory=list)
    # Each request's prefix-cache salt starts with a digest of its API key: tenants never share blocks.
    cache_salt_by_api_key: bool = False
    # The key that shows /metrics' prefix-cache figures (opens /metrics only); without it they are
    # shown only while fewer than two API keys are configured.
    metrics_api_key: Optional[str] = None
    # Sequences (prompts x n) waiting to be scheduled: a request that would take the count past this
    # gets 503 + Retry-After, one larger than it on its own a 400. 0 or None: no bound.
    max_waiting: Optional[int] = 4096
    # Sequences (prompts x n) one request may ask for; more: 400 naming the limit.
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    engine_stop_timeout: float = 30.0
    # A Jinja chat template used instead of the tokenizer's (a request's chat_template wins).
    chat_template: Optional[str] = None
    # tool_choice "auto" reads the model's calls with this parser (serve/openai/tool_parsers.py);
    # without enable_auto_tool_choice, "auto" is a 400 (vLLM's flags and behaviour).
    enable_auto_tool_choice: bool = False
    tool_call_parser: Optional[str] = None
    # Requests may carry their own chat_template (a Jinja template the server runs); off: a 400.
    trust_request_chat_template: bool = False
    # LoRA: the engine runs with enable_lora (None: as its config says, off if it has none to read);
    # lora_modules are already loaded into the engine (serve_cli adds them at start-up) and served
    # by name. api_server_count > 1: run-time loading and unloading is refused (per-process registry).
    enable_lora: Optional[bool] = None
    lora_modules: list[LoRAModule] = field(default_factory=list)
    api_server_count: int = 1
    # /v1/load_lora_adapter and /v1/unload_lora_adapter work only when allowed, and load only
    # directories under lora_roots (serve/openai/lora.py).
    allow_runtime_lora_updating: bool = False
    lora_roots: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.max_sequences_per_request < 1:
            raise ConfigError(f"max_sequences_per_request must be >= 1, got {self.max_sequences_per_request}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ConfigError(f"unknown tool-call parser {self.tool_call_parser!r} (known: "
                              f"{', '.join(sorted(TOOL_PARSERS))})")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                              f"{', '.join(sorted(TOOL_PARSERS))})")
        if self.allow_runtime_lora_updating and not self.lora_roots:
            raise ConfigError("--allow-runtime-lora-updating needs --lora-root DIR (where adapters may be loaded from)")
        keys = self.all_api_keys
        if any(not isinstance(k, str) or not k.strip() for k in keys):
            raise ConfigError("API keys must be non-empty strings")
        if self.cache_salt_by_api_key and not keys:
            raise ConfigError("--cache-salt-by-api-key needs API keys (--api-key or --api-key-file)")
        if self.metrics_api_key is not None and (not self.metrics_api_key.strip() or self.metrics_api_key in keys):
            raise ConfigError("--metrics-api-key must be a non-empty key of its own (not one of the API keys)")

    @property
    def all_api_keys(self) -> list[str]:
        return list(dict.fromkeys(self.api_keys + ([self.api_key] if self.api_key is not None else [])))

    def tenants(self) -> Tenants:
        return Tenants(self.all_api_keys, self.metrics_api_key, self.cache_salt_by_api_key)


class UnknownFieldLog:
    """Names each unknown request field once, at WARNING (a misspelt field would otherwise silently get
    its default); remembers at most LIMIT names, so clients cannot grow it or flood the log."""

    LIMIT = 256

    def __init__(self):
        self._seen: set[str] = set()

    def note(self, route: str, body) -> None:
        for name in body.model_extra or ():
            name = echoed(name)  # what is kept and logged of a name: at most its first 100 characters
            if name in self._seen or len(self._seen) > self.LIMIT:
                continue
            self._seen.add(name)
            if len(self._seen) > self.LIMIT:
                logger.warning("more than %d unknown request fields seen: no more are logged", self.LIMIT)
            else:
                logger.warning("%s: unknown field %r ignored (logged once per name)", route, name)


_ERROR_DESCRIPTIONS = {
    400: "Invalid request: the message says what is wrong (and `param` which field, when one is)",
    401: "Missing or wrong API key (send 'Authorization: Bearer <key>')",
    404: "No such model (or route, or LoRA adapter)",
    409: "Requests are running; try again when the server is idle",
    413: "The request body is larger than the server's limit",
    503: "Overloaded (retry after the Retry-After header's seconds) or the engine is not running",
}


def _errors(key_required: bool, *statuses: int) -> dict:
    """The `responses` of a route for the OpenAPI schema: its error statuses, with OpenAI's error body."""
    statuses = ((401,) if key_required else ()) + statuses
    return {s: {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[s]} for s in sorted(statuses)}


def _without_422(app: FastAPI) -> None:
    """FastAPI documents 422 for invalid input on every route with a body or parameters; this server
    answers 400 (in OpenAI's format) instead, so the schema drops it and its unused models."""
    generate = app.openapi

    def openapi() -> dict:
        schema = generate()  # built once, then cached by FastAPI
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        return schema

    app.openapi = openapi


def build_app(engine: AsyncLLMEngine, settings: Optional[ServerSettings] = None) -> FastAPI:
    """The app around an AsyncLLMEngine that is not started yet (the app's lifespan starts it)."""
    settings = settings or ServerSettings()
    names = list(settings.served_model_names or [engine.model_name])
    loras = lora_registry(engine, names, settings)
    metrics = ServerMetrics(names[0])
    metrics.attach(engine)
    if settings.max_waiting is not None:
        engine.max_waiting = settings.max_waiting if settings.max_waiting > 0 else None
    tenants = settings.tenants()
    completions = OpenAIServingCompletion(engine, names, metrics, settings.max_sequences_per_request, loras=loras,
                                          tenants=tenants)
    chat = OpenAIServingChat(engine, names, metrics, settings.max_sequences_per_request, loras=loras, tenants=tenants,
                             chat_template=settings.chat_template, tool_call_parser=settings.tool_call_parser,
                             enable_auto_tool_choice=settings.enable_auto_tool_choice,
                             trust_request_chat_template=settings.trust_request_chat_template)
    tokenization = OpenAIServingTokenization(chat)

    gc_policy = GCPolicy()

    async def collect_when_idle() -> None:
        while True:
            await asyncio.sleep(GC_CHECK_SECONDS)
            if engine.stats.num_active_groups == 0:
                gc_policy.on_idle()
            else:
                gc_policy.on_busy()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        gc.callbacks.append(metrics.gc_callback)
        engine.start()
        logger.info("engine started; serving %s", ", ".join(names))
        collector = asyncio.create_task(collect_when_idle())
        try:
            yield
        finally:
            collector.cancel()
            gc.callbacks.remove(metrics.gc_callback)
            await engine.stop(settings.engine_stop_timeout)

    app = FastAPI(title="tokenmill", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible completions and chat completions served by tokenmill.")
    app.state.engine = engine
    app.state.gc_policy = gc_policy  # run_server starts it (freezes what exists) once the app is built
    app.state.metrics = metrics
    app.state.loras = loras  # the LoRA adapters this process serves, by name
    app.state.tenants = tenants
    unknown = UnknownFieldLog()
    install_error_handlers(app, on_invalid=lambda: metrics.rejected("invalid"))
    _without_422(app)
    app.add_middleware(GuardMiddleware, tenants=tenants, max_body_bytes=settings.max_body_bytes,
                       on_invalid=lambda: metrics.rejected("invalid"))
    key = tenants.required
    _add_info_routes(app, engine, names, loras, metrics, tenants)
    _add_engine_routes(app, engine, completions, chat, key, unknown)
    _add_lora_routes(app, engine, loras, key, unknown)
    _add_tokenize_routes(app, tokenization, key, unknown)
    return app


def lora_registry(engine: AsyncLLMEngine, names: list[str], settings: ServerSettings) -> LoRARegistry:
    enabled = settings.enable_lora
    if enabled is None:
        enabled = bool(getattr(getattr(engine.engine, "config", None), "enable_lora", False))
    if settings.lora_modules and not enabled:
        raise ConfigError("LoRA modules were given but LoRA is not enabled (--enable-lora)")
    refusal = (f"loading and unloading LoRA adapters at run time is not supported with --api-server-count "
               f"{settings.api_server_count} (each API server process has its own list of adapters); serve "
               "them with --lora-modules, or run one API server process")
    return LoRARegistry(names, settings.lora_modules, enabled=enabled, dynamic=settings.api_server_count <= 1,
                        dynamic_refusal=refusal, runtime_updating=settings.allow_runtime_lora_updating,
                        roots=settings.lora_roots)


def _add_info_routes(app: FastAPI, engine: AsyncLLMEngine, names: list[str], loras: LoRARegistry,
                     metrics: ServerMetrics, tenants: Tenants) -> None:
    """Health, metrics, models and version."""
    created = int(time.time())
    key = tenants.required

    def model_card(name: str) -> dict:
        module = loras.get(name) if name not in names else None
        if module is not None:  # a LoRA adapter: parent its base model; root its name (no server path)
            return {"id": name, "object": "model", "created": created, "owned_by": "tokenmill",
                    "root": name, "parent": loras.parent_of(module), "max_model_len": engine.max_model_len}
        return {"id": name, "object": "model", "created": created, "owned_by": "tokenmill",
                "root": engine.model_name, "parent": None, "max_model_len": engine.max_model_len}

    @app.get("/health", responses=_errors(None, 503))
    async def health():
        if not engine.is_running:
            raise APIError(503, "the engine is not running", code="engine_unavailable")
        return {"status": "ok"}

    @app.get("/metrics", responses=_errors(key))
    async def get_metrics(request: Request):
        shown = tenants.shows_prefix_cache(dict(request.scope.get("headers") or []))
        return Response(metrics.render(prefix_cache=shown), media_type=CONTENT_TYPE)

    @app.get("/v1/models", responses=_errors(key))
    async def list_models():
        return {"object": "list", "data": [model_card(n) for n in names + loras.names()]}

    @app.get("/v1/models/{model_id:path}", responses=_errors(key, 404))
    async def get_model(model_id: str):
        if model_id not in names and loras.get(model_id) is None:
            raise APIError(404, f"the model `{echoed(model_id)}` does not exist", param="model",
                           code="model_not_found")
        return model_card(model_id)

    @app.get("/version", responses=_errors(key))
    async def version():
        return JSONResponse({"version": __version__})


def _add_engine_routes(app: FastAPI, engine: AsyncLLMEngine, completions: OpenAIServingCompletion,
                       chat: OpenAIServingChat, key: bool, unknown: UnknownFieldLog) -> None:
    """Completions, chat completions and the prefix-cache reset."""

    @app.post("/v1/completions", responses=_errors(key, 400, 404, 413, 503))
    async def create_completion(body: CompletionRequest, raw_request: Request):
        unknown.note("/v1/completions", body)
        return await completions.create(body, raw_request)

    @app.post("/v1/chat/completions", responses=_errors(key, 400, 404, 413, 503))
    async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request):
        unknown.note("/v1/chat/completions", body)
        return await chat.create(body, raw_request)

    @app.post("/reset_prefix_cache", responses=_errors(key, 409, 413, 503))
    async def reset_prefix_cache():
        """Forget the prefix cache (benchmarks call it between runs); only while no request runs."""
        if not await engine.call(lambda e: e.reset_prefix_cache()):
            raise APIError(409, "requests are running; the prefix cache can only be reset when idle",
                           code="engine_busy")
        return {"status": "ok"}


def _lora_api_error(e: LoRARegistryError) -> APIError:
    return APIError(e.status, e.message, param=e.param, code=e.code)


def _add_lora_routes(app: FastAPI, engine: AsyncLLMEngine, loras: LoRARegistry, key: bool,
                     unknown: UnknownFieldLog) -> None:
    """/v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes; plain-text success)."""

    async def add(request) -> None:
        await engine.call(lambda e: e.add_lora(request))

    async def remove(lora_int_id: int) -> None:
        if not await engine.call(lambda e: e.remove_lora(lora_int_id)):
            logger.debug("LoRA adapter id %d was not in the engine's memory when unloaded", lora_int_id)

    @app.post("/v1/load_lora_adapter", responses=_errors(key, 400, 413, 503))
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        """Load a LoRA adapter (a PEFT directory on the server's machine); requests then name it as `model`."""
        unknown.note("/v1/load_lora_adapter", body)
        try:
            module = await loras.load(body.lora_name, body.lora_path, add)
        except LoRARegistryError as e:
            raise _lora_api_error(e) from None
        except LoRAError as e:
            logger.warning("LoRA adapter %r from %s not loaded: %s", body.lora_name, body.lora_path, e)
            raise APIError(400, str(e), param="lora_path", code="invalid_lora_adapter") from None
        except InvalidRequestError as e:
            raise APIError(400, str(e), code="invalid_lora_adapter") from None
        logger.info("loaded LoRA adapter %s (id %d) from %s", module.name, module.request.lora_int_id, module.path)
        return PlainTextResponse(f"Success: LoRA adapter '{module.name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", responses=_errors(key, 400, 404, 413, 503))
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        """Stop serving a LoRA adapter; requests already running with it finish with it."""
        unknown.note("/v1/unload_lora_adapter", body)
        try:
            module = await loras.unload(body.lora_name, body.lora_int_id, remove)
        except LoRARegistryError as e:
            raise _lora_api_error(e) from None
        logger.info("unloaded LoRA adapter %s (id %d)", module.name, module.request.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{module.name}' removed successfully.")


def _add_tokenize_routes(app: FastAPI, tokenization: OpenAIServingTokenization, key: bool,
                         unknown: UnknownFieldLog) -> None:
    """/tokenize and /detokenize (vLLM's routes)."""

    @app.post("/tokenize", responses=_errors(key, 400, 404, 413))
    async def tokenize(body: TokenizeRequest):
        """A prompt's token ids, or those of chat messages rendered with the chat template."""
        unknown.note("/tokenize", body)
        return JSONResponse(await tokenization.tokenize(body))

    @app.post("/detokenize", responses=_errors(key, 400, 404, 413))
    async def detokenize(body: DetokenizeRequest):
        """The text of token ids."""
        unknown.note("/detokenize", body)
        return JSONResponse(await tokenization.detokenize(body))


class Server(uvicorn.Server):
    """uvicorn's server with these changes for a graceful shutdown:

    - when the grace period is over, the engine is stopped, which aborts what still runs: streams
      end with an error event and [DONE], other requests get a 503, so every connection closes
      cleanly instead of uvicorn cancelling handlers mid-flight (uvicorn's own timeout, a little
      longer, stays as a backstop);
    - a second SIGINT or SIGTERM ends the grace period at once: the engine is stopped (aborting
      what runs, as above), connections get FORCED_CLOSE_SECONDS to send their last events, and
      `forced_by` records the signal (run_server exits 128 + its number);
    - the caught signal is not re-raised afterwards (which would end the process by SIGTERM or
      KeyboardInterrupt instead of an exit status of ours).
    """

    def __init__(self, config, engine: AsyncLLMEngine, grace: Optional[float],
                 on_signal: Optional[Callable[[int], None]] = None):
        super().__init__(config)
        self.engine = engine
        self.grace = grace
        self.on_signal = on_signal  # told of each signal (e.g. to pass it on to the other API servers)
        self.forced_by: Optional[int] = None  # the second signal, if one came

    def handle_exit(self, sig: int, frame) -> None:
        # A signal handler: it only sets flags (the shutdown task below acts on them).
        if self.should_exit and self.forced_by is None:
            self.forced_by = sig
        self.should_exit = True
        if self.on_signal is not None:
            self.on_signal(sig)

    async def shutdown(self, sockets=None):
        stopper = asyncio.create_task(self._abort_when_due())
        try:
            await super().shutdown(sockets)
        finally:
            stopper.cancel()

    async def _abort_when_due(self) -> None:
        await self._until_forced(self.grace)
        if self.forced_by is None:
            logger.warning("grace period of %.1f s over: aborting the requests still running", self.grace)
        else:
            logger.warning("second signal (%s): aborting the requests still running",
                           signal.Signals(self.forced_by).name)
        await self.engine.stop()
        await self._until_forced(None)
        await asyncio.sleep(FORCED_CLOSE_SECONDS)
        self.force_exit = True  # stop waiting for connections that are still open

    async def _until_forced(self, seconds: Optional[float]) -> None:
        """Wait `seconds` (None: for ever), or less if a second signal comes."""
        deadline = None if seconds is None else time.monotonic() + seconds
        while self.forced_by is None and (deadline is None or time.monotonic() < deadline):
            await asyncio.sleep(0.05)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = [signal.SIGINT, signal.SIGTERM]
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def run_server(engine: EngineClient, *, host: str = "127.0.0.1", port: int = 8000, settings: Optional[ServerSettings] = None,
               shutdown_grace: Optional[float] = 30.0, log_level: str = "info", access_log: bool = False,
               sock: Optional[socket.socket] = None, on_signal: Optional[Callable[[int], None]] = None) -> int:
    """Serve an engine (any EngineClient: in process, an engine process, or replicas) until SIGINT/SIGTERM,
    on `sock` if given (a listening socket shared by several API server processes), else on
    host:port; on_signal hears of each signal. Returns the exit status: 0 after a graceful shutdown,
    128 + the signal's number after a second signal forced it, 1 if the engine failed or the server
    could not start."""
    dump_stacks_on_sigusr1()
    async_engine = AsyncLLMEngine(engine)
    app = build_app(async_engine, settings)
    backstop = None if shutdown_grace is None else shutdown_grace + 10.0
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=backstop, lifespan="on", timeout_keep_alive=30)
    server = Server(config, async_engine, shutdown_grace, on_signal)
    # What exists now (model or tokenizer, modules) lives as long as the process: frozen out of the
    # collector's full passes, which run only while no request does (GCPolicy; their pauses stop every
    # thread: the streams, and an in-process engine). Unfrozen afterwards, so the collections at
    # interpreter exit free it: frozen objects are never freed, and native extensions (Triton's,
    # built with nanobind) then report each of theirs as leaked on stderr.
    app.state.gc_policy.start()
    try:
        server.run(sockets=[sock] if sock is not None else None)
    finally:
        app.state.gc_policy.stop()
    if async_engine.error is not None:
        logger.error("the engine failed: %r", async_engine.error)
        return 1
    if server.forced_by is not None:
        return 128 + server.forced_by
    return 0 if server.started else 1
