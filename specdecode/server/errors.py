"""OpenAI-style errors: every 4xx/5xx body is {"error": {"message", "type", "param", "code"}}.

The official clients read `error.message`, so the message alone must say what to fix.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

# HTTP status -> OpenAI's error "type" (what their API sends for the same status). The type says what the client
# should do: fix the request (invalid_request_error), retry later (timeout_error: a deadline passed, the body's or
# the request's; rate_limit_error; server_error), or check its key or model name.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    504: "timeout_error",
}


class ApiError(Exception):
    """A request the server refuses; raised anywhere in a handler, turned into a JSON error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": _printable(message), "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": None if param is None else _printable(param), "code": code}}


def _printable(text: str) -> str:
    """A message that quotes the client's text must still encode as UTF-8 (a lone surrogate shows as \\udxxx)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(error_body(err.status, err.message, err.param, err.code), status_code=err.status,
                        headers=err.headers)
