"""The OpenAI-compatible HTTP server: the FastAPI app factory and `run_server`.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models(/{id}), GET /health,
GET /metrics (Prometheus text), GET /version, POST /reset_prefix_cache (for benchmarks). The engine
runs on its own thread (AsyncLLMEngine), started and stopped with the app's lifespan. On SIGINT or
SIGTERM uvicorn stops accepting and waits for in-flight requests; after the grace period the engine
is stopped, which aborts what still runs (see Server below); then the process exits 0.
"""

import asyncio
import contextlib
import gc
import signal
import threading
import time
from dataclasses import dataclass
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenmill import __version__
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.entrypoints.openai.errors import APIError, install_error_handlers
from tokenmill.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from tokenmill.entrypoints.openai.middleware import GuardMiddleware
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenmill.entrypoints.openai.serving_completions import OpenAIServingCompletion
from tokenmill.logger import init_logger

logger = init_logger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 << 20


@dataclass
class ServerSettings:
    served_model_names: Optional[list[str]] = None  # default: the engine's model name
    api_key: Optional[str] = None
    max_waiting: Optional[int] = 4096  # requests (samples) waiting; past it new requests get 503
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    engine_stop_timeout: float = 30.0


def build_app(engine: AsyncLLMEngine, settings: Optional[ServerSettings] = None) -> FastAPI:
    """The app around an AsyncLLMEngine that is not started yet (the app's lifespan starts it)."""
    settings = settings or ServerSettings()
    names = list(settings.served_model_names or [engine.model_name])
    metrics = ServerMetrics(names[0])
    metrics.attach(engine)
    if settings.max_waiting is not None:
        engine.max_waiting = settings.max_waiting if settings.max_waiting > 0 else None
    completions = OpenAIServingCompletion(engine, names, metrics)
    chat = OpenAIServingChat(engine, names, metrics)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        gc.callbacks.append(metrics.gc_callback)
        engine.start()
        logger.info("engine started; serving %s", ", ".join(names))
        try:
            yield
        finally:
            gc.callbacks.remove(metrics.gc_callback)
            await engine.stop(settings.engine_stop_timeout)

    app = FastAPI(title="tokenmill", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible completions and chat completions served by tokenmill.")
    app.state.engine = engine
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes)

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "tokenmill",
                "root": engine.model_name, "max_model_len": engine.max_model_len}

    @app.get("/health")
    async def health():
        if not engine.is_running:
            raise APIError(503, "the engine is not running", code="engine_unavailable")
        return {"status": "ok"}

    @app.get("/metrics")
    async def get_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card(n) for n in names]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        if model_id not in names:
            raise APIError(404, f"the model `{model_id}` does not exist", param="model", code="model_not_found")
        return model_card(model_id)

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw_request: Request):
        return await completions.create(body, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request):
        return await chat.create(body, raw_request)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """Forget the prefix cache (benchmarks call it between runs); only while no request runs."""
        def reset(e) -> bool:
            if e.has_unfinished_requests():
                return False
            e.kv.reset_prefix_cache()
            return True

        if not await engine.call(reset):
            raise APIError(409, "requests are running; the prefix cache can only be reset when idle",
                           code="engine_busy")
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return JSONResponse({"version": __version__})

    return app


def _uvicorn_server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server with two changes for a graceful shutdown:

        - when the grace period is over, the engine is stopped, which aborts what still runs: streams
          end with an error event and [DONE], other requests get a 503, so every connection closes
          cleanly instead of uvicorn cancelling handlers mid-flight (uvicorn's own timeout, a little
          longer, stays as a backstop);
        - the caught signal is not re-raised afterwards (which would end the process by SIGTERM or
          KeyboardInterrupt instead of exit status 0).
        """

        def __init__(self, config, engine: AsyncLLMEngine, grace: Optional[float]):
            super().__init__(config)
            self.engine = engine
            self.grace = grace

        async def shutdown(self, sockets=None):
            stopper = None
            if self.grace is not None:
                async def stop_engine_later():
                    await asyncio.sleep(self.grace)
                    logger.warning("grace period of %.1f s over: aborting the requests still running", self.grace)
                    await self.engine.stop()

                stopper = asyncio.create_task(stop_engine_later())
            try:
                await super().shutdown(sockets)
            finally:
                if stopper is not None:
                    stopper.cancel()

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

    return Server


def run_server(engine, *, host: str = "127.0.0.1", port: int = 8000, settings: Optional[ServerSettings] = None,
               shutdown_grace: Optional[float] = 30.0, log_level: str = "info", access_log: bool = False) -> int:
    """Serve an LLMEngine until SIGINT/SIGTERM; returns the exit status."""
    import uvicorn

    async_engine = AsyncLLMEngine(engine)
    app = build_app(async_engine, settings)
    backstop = None if shutdown_grace is None else shutdown_grace + 10.0
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=backstop, lifespan="on", timeout_keep_alive=30)
    server = _uvicorn_server_class()(config, async_engine, shutdown_grace)
    # What exists now (model, tokenizer, modules) lives as long as the process: keep it out of the
    # collector's full passes, whose pauses stop the engine thread too.
    gc.collect()
    gc.freeze()
    server.run()
    if async_engine.error is not None:
        logger.error("the engine failed: %r", async_engine.error)
        return 1
    return 0 if server.started else 1
