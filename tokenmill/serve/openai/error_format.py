"""OpenAI's error body, {"error": {"message", "type", "param", "code"}}, with nothing else imported:
the proxy (serve/disagg_proxy.py), which runs no engine, answers in the same shape as the server."""

from typing import Optional

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable_error"}


def error_body(status: int, message: str, type: Optional[str] = None, param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type or ERROR_TYPES.get(status, "internal_server_error"),
                      "param": param, "code": code}}
