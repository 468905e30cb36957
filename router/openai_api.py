"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from router.service import Service

OPENAI_TYPES = {422: "invalid_request_error", 400: "invalid_request_error", 401: "authentication_error",
                429: "rate_limit_error", 503: "server_error", 424: "server_error"}


def openai_error(status: int, message: str, kind: str) -> JSONResponse:
    body = {"error": {"message": message, "type": OPENAI_TYPES.get(status, "server_error"), "param": None,
                      "code": kind}}
    return JSONResponse(body, status_code=status)


def install_openai_routes(app: FastAPI, svc: Service) -> None:
    """Filled in by the OpenAI surface (issue 4)."""
