"""Errors in OpenAI's format: {"error": {"message", "type", "param", "code"}} with the matching status.

Bad input is always a 4xx with a message that names the problem; a 5xx means a bug or an overload.
"""

import json
from typing import Any, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.serve.async_engine import EngineDeadError, EngineOverloadedError
from tokenmill.serve.openai.error_format import ERROR_TYPES, error_body
from tokenmill.errors import InvalidRequestError
from tokenmill.logger import init_logger

logger = init_logger(__name__)

_TYPES = ERROR_TYPES  # (the error body and its types: error_format.py, shared with the proxy)


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: Optional[str] = None, param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "internal_server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers


MAX_ECHOED_CHARS = 100  # of a client's value quoted back in a message


def echoed(value: str) -> str:
    """A client's value as a message quotes it: at most MAX_ECHOED_CHARS characters of it."""
    if len(value) <= MAX_ECHOED_CHARS:
        return value
    return f"{value[:MAX_ECHOED_CHARS]}... ({len(value)} characters)"


class _ErrorJSONResponse(JSONResponse):
    """JSON with non-ASCII characters escaped: a message may quote the client's input, which can hold a
    lone surrogate that has no UTF-8 encoding (JSON's \\ud800 escape)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_response(err: APIError) -> JSONResponse:
    return _ErrorJSONResponse(error_body(err.status, err.message, err.type, err.param, err.code),
                              status_code=err.status, headers=err.headers)


def to_api_error(exc: BaseException) -> APIError:
    """Map an exception from the engine or the handlers to what the client gets."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc))
    if isinstance(exc, EngineOverloadedError):
        return APIError(503, str(exc), type="server_overloaded", code="server_overloaded",
                        headers={"Retry-After": "1"})
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_unavailable")
    return APIError(500, f"internal error: {type(exc).__name__}", type="internal_server_error")


def stream_error_event(exc: BaseException) -> str:
    """An error inside a stream that already answered 200: one SSE event in the error format."""
    err = to_api_error(exc)
    return f"data: {json.dumps(error_body(err.status, err.message, err.type, err.param, err.code))}\n\n"


_UNION_HINTS = {
    "prompt": "must be a string, a list of strings, a list of token ids, or a list of token-id lists",
    "stop": "must be a string or a list of strings",
    "content": "must be a string or a list of content parts",
    "tool_choice": "must be a string or an object",
}


def _is_union_tag(part) -> bool:
    # pydantic names the union member inside the location: "str", "list[int]", "function-after[...]"...
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "dict", "list", "none")
                                      or any(c in part for c in "[]()"))


def _describe(errors: list[dict[str, Any]]) -> tuple[str, Optional[str]]:
    """One readable message for pydantic's validation errors, and the first field at fault."""
    parts, param, unions_done = [], None, set()
    for e in errors:
        loc = [x for x in e.get("loc", ()) if x != "body"]
        if e.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON ({(e.get('ctx') or {}).get('error', 'parse error')})")
            continue
        if not loc:
            parts.append("the body must be a JSON object" if e.get("type") != "missing" else
                         "a JSON object body is required")
            continue
        tag_at = next((i for i, x in enumerate(loc) if _is_union_tag(x)), None)
        if tag_at is not None:
            field_path = ".".join(str(x) for x in loc[:tag_at])
            name = str(loc[tag_at - 1]) if tag_at else ""
            if field_path in unions_done:
                continue
            if name in _UNION_HINTS:
                unions_done.add(field_path)
                value = None
                for x in errors:  # the member error at the union itself carries the whole value
                    xloc = [y for y in x.get("loc", ()) if y != "body"]
                    if len(xloc) == tag_at + 1 and xloc[:tag_at] == loc[:tag_at] and "input" in x:
                        value = x["input"]
                        break
                parts.append(f"{field_path}: {_UNION_HINTS[name]}" + (_shown(value) if value is not None else ""))
                param = param or field_path
                continue
        path = ".".join(str(x) for x in loc if not _is_union_tag(x))
        msg = e.get("msg", "invalid value")
        if "input" in e and e.get("type") != "missing":
            msg += _shown(e["input"])
        parts.append(f"{path}: {msg}")
        param = param or path
    parts = list(dict.fromkeys(parts))
    if len(parts) > 5:
        parts = parts[:5] + [f"and {len(parts) - 5} more problem(s)"]
    return "invalid request: " + "; ".join(parts), param


def _shown(value) -> str:
    shown = repr(value)
    return f" (got {shown[:60] + '...' if len(shown) > 60 else shown})"


def install_error_handlers(app: FastAPI, on_invalid: Optional[Callable[[], None]] = None) -> None:
    """OpenAI's error format for every error a route raises; `on_invalid` is told of each 400 (a request
    refused as invalid, whichever check refused it: the body's schema, the handler's or the engine's)."""

    def respond(err: APIError) -> JSONResponse:
        if err.status == 400 and on_invalid is not None:
            on_invalid()
        return error_response(err)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return respond(exc)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError):
        return respond(to_api_error(exc))

    @app.exception_handler(EngineOverloadedError)
    async def _overloaded(request: Request, exc: EngineOverloadedError):
        return respond(to_api_error(exc))

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError):
        return respond(to_api_error(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = _describe(list(exc.errors()))
        return respond(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return respond(APIError(exc.status_code, detail, code=code, headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}", type="internal_server_error"))
