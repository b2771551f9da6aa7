"""The gate in front of every route: the API key (any of the server's: serve/openai/tenants.py), then
the size of the request body.

Plain ASGI (no BaseHTTPMiddleware), so streaming responses pass through untouched. The key is
checked before the body is read, so a client without it learns nothing else; /health stays open.
The body is read here, at most `max_body_bytes` of it, and replayed to the app as JSON.
"""

import json
from typing import Callable, Optional

from tokenmill.serve.openai.errors import error_body
from tokenmill.serve.openai.tenants import Tenants

OPEN_PATHS = frozenset({"/health"})


async def _send_error(send, status: int, message: str, code: str, headers: Optional[list] = None) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")] + (headers or [])})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    def __init__(self, app, tenants: Optional[Tenants] = None, max_body_bytes: int = 4 << 20,
                 on_invalid: Optional[Callable[[], None]] = None):
        self.app = app
        self.tenants = tenants or Tenants()
        self.max_body_bytes = max_body_bytes
        self.on_invalid = on_invalid  # told of each 400 answered here (the rejected-requests counter)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        path = scope.get("path")
        if self.tenants.required and path not in OPEN_PATHS and not self.tenants.authorized(path, headers):
            return await _send_error(send, 401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                                     "invalid_api_key", [(b"www-authenticate", b"Bearer")])
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        limit = self.max_body_bytes
        too_large = f"the request body is larger than the limit of {limit} bytes"
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                if int(declared) > limit:
                    return await _send_error(send, 413, too_large, "request_too_large")
            except ValueError:
                if self.on_invalid is not None:
                    self.on_invalid()
                return await _send_error(send, 400, "invalid Content-Length header", "invalid_header")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await _send_error(send, 413, too_large, "request_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        if b"json" not in headers.get(b"content-type", b"").lower():
            # Every body this API takes is JSON: read it as such whatever the client declared (curl -d
            # sends a form content type), so the client gets a JSON parse error rather than a type error.
            scope = dict(scope, headers=[(k, v) for k, v in scope["headers"] if k != b"content-type"]
                         + [(b"content-type", b"application/json")])
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: waits for http.disconnect

        return await self.app(scope, replay, send)
