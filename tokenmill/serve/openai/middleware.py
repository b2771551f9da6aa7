"""The gate in front of every route: the API key, then the size of the request body.

Plain ASGI (no BaseHTTPMiddleware), so streaming responses pass through untouched. The key is
checked before the body is read, so a client without it learns nothing else; /health stays open.
The body is read here, at most `max_body_bytes` of it, and replayed to the app as JSON.
"""

import hmac
import json
from typing import Optional

from tokenmill.serve.openai.errors import error_body

OPEN_PATHS = frozenset({"/health"})


async def _send_error(send, status: int, message: str, code: str, headers: Optional[list] = None) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")] + (headers or [])})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    def __init__(self, app, api_key: Optional[str] = None, max_body_bytes: int = 4 << 20):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    def _authorized(self, headers: dict) -> bool:
        value = headers.get(b"authorization", b"")
        scheme, _, token = value.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and scope.get("path") not in OPEN_PATHS and not self._authorized(headers):
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
