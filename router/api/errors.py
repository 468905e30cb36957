"""Every error a client sees, built in one place: TGI's shape `{"error", "error_type"}` on TGI's routes, OpenAI's
`{"error": {"message", "type", "param", "code"}}` under /v1/."""
import re
from typing import Optional

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from router import metrics

OPENAI_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 408: "invalid_request_error",
                413: "invalid_request_error",
                422: "invalid_request_error", 401: "authentication_error", 429: "rate_limit_error"}


class APIError(Exception):
    """A refused or failed request: its status, a message for people, a kind for programs (TGI's
    error_type, OpenAI's code) and, on OpenAI's routes, the offending field."""

    def __init__(self, status: int, message: str, kind: str, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def is_openai(path: str) -> bool:
    return path.startswith("/v1/")


def error_body(openai: bool, status: int, message: str, kind: str, param: Optional[str] = None) -> dict:
    if openai:
        return {"error": {"message": message, "type": OPENAI_TYPES.get(status, "server_error"), "param": param,
                          "code": kind}}
    return {"error": message, "error_type": kind}


def error_response(path: str, status: int, message: str, kind: str, param: Optional[str] = None) -> JSONResponse:
    return JSONResponse(error_body(is_openai(path), status, message, kind, param), status_code=status)


PYDANTIC_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def field_path(loc) -> str:
    """A pydantic error's location as the client wrote it: `messages.0.content`, without "body" and the union
    branches pydantic names ("str", "list[int]", "function-after[...]")."""
    return ".".join(str(x) for x in loc if isinstance(x, int)
                    or (x != "body" and x not in PYDANTIC_TAGS and re.fullmatch(r"\w+", x)))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_invalid(request, exc: RequestValidationError):
        """The most telling error: a value refused for what it is (NaN, a lone surrogate) before a union's type
        mismatches."""
        metrics.outcome("validation")
        first = min(exc.errors(), key=lambda e: str(e.get("type", "")).endswith("_type"), default={})
        where = field_path(first.get("loc", ()))
        message = f"{where}: {first.get('msg', 'invalid request')}".lstrip(": ")
        return error_response(request.url.path, 422, message, "validation", where or None)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request, exc: StarletteHTTPException):
        kinds = {400: "validation", 422: "validation", 408: "timeout", 413: "payload_too_large"}
        kind = kinds.get(exc.status_code, "http")
        return error_response(request.url.path, exc.status_code, str(exc.detail), kind)

    @app.exception_handler(APIError)
    async def on_api_error(request, exc: APIError):
        return error_response(request.url.path, exc.status, exc.message, exc.kind, exc.param)

    @app.exception_handler(Exception)
    async def on_bug(request, exc: Exception):
        """A bug still answers in the route's shape (Starlette logs the traceback after this response)."""
        return error_response(request.url.path, 500, f"internal error: {type(exc).__name__}", "internal")
