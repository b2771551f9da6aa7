"""`tokenmill proxy`: the routing front of prefill/decode disaggregation (one client request, two engines).

Each /v1/completions or /v1/chat/completions request goes first to the prefill engine as the same
request with max_tokens 1 and no stream (that engine, a `tokenmill serve` with the
SharedStorageConnector as kv_producer, writes the prompt's KV blocks before it answers), then, as
the client sent it, to the decode engine (kv_consumer: it loads those blocks and computes only the
rest), whose answer, streamed or not, goes back to the client unchanged. The proxy holds no model
and no request state; it reads JSON bodies only to rewrite the prefill copy.

Faults: a peer that cannot be reached, or that fails during the request, is a 503 in OpenAI's error
format naming the peer (a stream already under way ends with such an error event); a peer that does
not answer in time a 504; connections are refused at once by a dead peer on this host, and the
connect timeout bounds the rest, so nothing hangs. A peer's own refusal (400, 503 overloaded, ...)
is passed through as it came. A client that disconnects closes the proxy's connection to whichever
peer is working on its request, and `tokenmill serve` aborts a request whose client is gone, freeing
its KV blocks. /health is 200 only while both peers' /health are.
"""

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Optional

import anyio
import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.logger import init_logger
from tokenmill.serve.openai.error_format import error_body

logger = init_logger(__name__)

# Fields the prefill copy leaves out: more than one sample, streaming and output-length floors mean
# nothing for a single token; max_completion_tokens would override max_tokens on chat.
PREFILL_DROPPED = ("n", "best_of", "stream_options", "min_tokens", "max_completion_tokens")
FORWARDED_HEADERS = ("authorization",)  # the peers may require the client's API key
ROUTES = ("/v1/completions", "/v1/chat/completions")


@dataclass
class ProxySettings:
    prefill_url: str  # e.g. http://127.0.0.1:8100 (a `tokenmill serve` with kv_role kv_producer)
    decode_url: str  # e.g. http://127.0.0.1:8200 (kv_role kv_consumer)
    connect_timeout: float = 3.0  # seconds to reach a peer
    timeout: float = 600.0  # seconds a peer may take to answer (the prefill), or between two stream chunks
    health_timeout: float = 2.0  # seconds each peer's /health may take
    max_body_bytes: int = 4 << 20

    def __post_init__(self) -> None:
        self.prefill_url = self.prefill_url.rstrip("/")
        self.decode_url = self.decode_url.rstrip("/")


class _ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def prefill_body(body: dict) -> dict:
    """The prefill engine's copy of a request: one output token, not streamed."""
    copy = {k: v for k, v in body.items() if k not in PREFILL_DROPPED}
    copy.update(max_tokens=1, stream=False)
    return copy


def needs_prefill(body: dict) -> bool:
    """Prompt logprobs need every prompt position computed where they are asked (the decode engine
    loads no prefix for them): the prefill would be wasted."""
    return body.get("prompt_logprobs") is None


def _json_error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(error_body(status, message, code=code), status_code=status)


def peer_error(role: str, url: str, exc: Exception, timeout: float) -> JSONResponse:
    """The client's answer when a peer could not be reached or failed mid-request."""
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        what = f"the {role} engine at {url} is unreachable ({detail})"
    elif isinstance(exc, httpx.TimeoutException):
        logger.warning("the %s engine at %s did not answer within %.0f s", role, url, timeout)
        return _json_error(504, f"the {role} engine at {url} did not answer within {timeout:.0f} s",
                           f"{role}_timeout")
    else:
        what = f"the {role} engine at {url} failed during the request ({detail})"
    logger.warning("%s", what)
    return _json_error(503, what, f"{role}_unavailable")


async def _until_disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read already: receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _or_client_gone(watcher: asyncio.Task, work):
    """Await `work` unless the client goes first: then it is cancelled (closing its connection to
    the peer, which aborts the request there) and _ClientGone is raised."""
    task = asyncio.ensure_future(work)
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise _ClientGone()


class _RelayedStream(StreamingResponse):
    """The decode engine's event stream, chunk by chunk; closes the upstream response however the
    client's ends (a client that leaves closes it at once, so the decode engine aborts)."""

    def __init__(self, upstream: httpx.Response, url: str):
        self.upstream = upstream
        self.url = url
        super().__init__(self._chunks(), status_code=upstream.status_code,
                         media_type=upstream.headers.get("content-type", "text/event-stream"),
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _chunks(self):
        try:
            async for chunk in self.upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            message = f"the decode engine at {self.url} failed mid-stream ({type(e).__name__})"
            logger.warning("%s", message)
            yield f"data: {json.dumps(error_body(503, message, code='decode_unavailable'))}\n\n".encode()
            yield b"data: [DONE]\n\n"

    async def __call__(self, scope, receive, send):
        # The client's disconnect is watched for even while no chunk comes (a send would only fail
        # at the next one), so a decode waiting in its engine's queue is aborted at once.
        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client went away mid-send
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):  # (cancelled by a disconnect: close it all the same)
                await self.upstream.aclose()


def _passed_on(resp: httpx.Response, content: bytes) -> Response:
    headers = {k: resp.headers[k] for k in ("retry-after",) if k in resp.headers}
    return Response(content, status_code=resp.status_code, headers=headers,
                    media_type=resp.headers.get("content-type", "application/json"))


def build_proxy_app(settings: ProxySettings) -> FastAPI:
    timeout = httpx.Timeout(settings.timeout, connect=settings.connect_timeout)
    # No pool limit: every client stream holds one decode connection for its whole length.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    holder: dict[str, httpx.AsyncClient] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        holder["client"] = httpx.AsyncClient(timeout=timeout, limits=limits)
        logger.info("proxy: prefill %s, decode %s", settings.prefill_url, settings.decode_url)
        try:
            yield
        finally:
            await holder.pop("client").aclose()

    app = FastAPI(title="tokenmill proxy", lifespan=lifespan,
                  description="Prefill/decode disaggregation: prompts to one engine, decodes to another.")

    async def relay(request: Request, route: str) -> Response:
        client = holder["client"]
        raw = await request.body()
        if len(raw) > settings.max_body_bytes:
            return _json_error(413, f"the request body is larger than the limit of {settings.max_body_bytes} bytes",
                               "request_too_large")
        try:
            body = json.loads(raw)
        except ValueError as e:
            return _json_error(400, f"the body is not valid JSON ({e})", "invalid_json")
        if not isinstance(body, dict):
            return _json_error(400, "the body must be a JSON object", "invalid_json")
        headers = {k: request.headers[k] for k in FORWARDED_HEADERS if k in request.headers}
        watcher = asyncio.create_task(_until_disconnected(request))
        try:
            if needs_prefill(body):
                url = settings.prefill_url
                try:
                    done = await _or_client_gone(watcher, client.post(url + route, json=prefill_body(body),
                                                                      headers=headers))
                except httpx.HTTPError as e:
                    return peer_error("prefill", url, e, settings.timeout)
                if done.status_code != 200:  # the prefill engine refused it (bad request, overloaded...)
                    return _passed_on(done, done.content)
            url = settings.decode_url
            try:
                upstream = await _or_client_gone(watcher, client.send(
                    client.build_request("POST", url + route, json=body, headers=headers), stream=True))
            except httpx.HTTPError as e:
                return peer_error("decode", url, e, settings.timeout)
            if body.get("stream") and upstream.status_code == 200:
                return _RelayedStream(upstream, url)
            try:
                content = await _or_client_gone(watcher, upstream.aread())
            except httpx.HTTPError as e:
                return peer_error("decode", url, e, settings.timeout)
            finally:
                await upstream.aclose()
            return _passed_on(upstream, content)
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it; the peers' requests were aborted
        finally:
            watcher.cancel()  # (before a stream starts: Starlette then watches the client itself)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await relay(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await relay(request, "/v1/chat/completions")

    async def peer_down(role: str, url: str, path: str = "/health") -> Optional[str]:
        try:
            r = await holder["client"].get(url + path, timeout=settings.health_timeout)
        except httpx.HTTPError as e:
            return f"the {role} engine at {url} is unreachable ({type(e).__name__})"
        return None if r.status_code == 200 else f"the {role} engine at {url} answered {r.status_code} on {path}"

    @app.get("/health")
    async def health():
        down = [m for m in await asyncio.gather(peer_down("prefill", settings.prefill_url),
                                                peer_down("decode", settings.decode_url)) if m]
        if down:
            return _json_error(503, "; ".join(down), "peer_unavailable")
        return {"status": "ok", "prefill": settings.prefill_url, "decode": settings.decode_url}

    @app.get("/v1/models")
    async def models(request: Request):
        """The decode engine's models (the names clients send)."""
        headers = {k: request.headers[k] for k in FORWARDED_HEADERS if k in request.headers}
        try:
            r = await holder["client"].get(settings.decode_url + "/v1/models", headers=headers,
                                           timeout=settings.health_timeout)
        except httpx.HTTPError as e:
            return peer_error("decode", settings.decode_url, e, settings.health_timeout)
        return _passed_on(r, r.content)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request):
        """Both engines forget their prefix caches (benchmarks call it between runs)."""
        headers = {k: request.headers[k] for k in FORWARDED_HEADERS if k in request.headers}
        for role, url in (("prefill", settings.prefill_url), ("decode", settings.decode_url)):
            try:
                r = await holder["client"].post(url + "/reset_prefix_cache", headers=headers)
            except httpx.HTTPError as e:
                return peer_error(role, url, e, settings.timeout)
            if r.status_code != 200:
                return _passed_on(r, r.content)
        return {"status": "ok"}

    return app


def run_proxy(settings: ProxySettings, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
              access_log: bool = False) -> int:
    """Serve the proxy until SIGINT/SIGTERM (uvicorn's graceful shutdown: in-flight streams finish)."""
    config = uvicorn.Config(build_proxy_app(settings), host=host, port=port, log_level=log_level, lifespan="on",
                            access_log=access_log, timeout_keep_alive=30, timeout_graceful_shutdown=30)
    server = uvicorn.Server(config)
    server.run()
    return 0 if server.started else 1
