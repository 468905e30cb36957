"""Checks made before a request reaches a route: the API key, the payload limit and the body's time limit (pure
ASGI, so streaming responses and disconnect detection pass through untouched)."""
import asyncio
import hmac
import json
import time
from typing import Optional

from starlette.exceptions import HTTPException

from router.api.errors import error_body, is_openai

OPEN_PATHS = {"/health", "/metrics", "/info"}


class Guards:
    def __init__(self, app, api_key: Optional[str], payload_limit: int, body_timeout: float):
        self.app = app
        self.api_key = api_key
        self.payload_limit = payload_limit
        self.body_timeout = body_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
                return await _refuse(send, scope, 401, "Unauthorized: a valid `Authorization: Bearer` key is required",
                                     "authentication")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.payload_limit:
            return await _refuse(send, scope, 413, f"Payload too large: the limit is {self.payload_limit} bytes",
                                 "payload_too_large")
        seen, whole, give_up = 0, False, time.monotonic() + self.body_timeout

        async def limited_receive():
            """The body, within the payload limit and the body timeout; after it, receive() as it is (it also
            reports disconnects while a response streams, which may take any time)."""
            nonlocal seen, whole
            if whole:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, give_up - time.monotonic()))
            except asyncio.TimeoutError:
                raise BodyTooSlow(self.body_timeout) from None
            seen += len(message.get("body", b""))
            whole = not message.get("more_body", False)
            if seen > self.payload_limit:
                raise PayloadTooLarge(self.payload_limit)
            return message

        await self.app(scope, limited_receive, send)


class BodyTooSlow(HTTPException):
    def __init__(self, timeout: float):
        super().__init__(408, f"Request timeout: the body did not arrive within {timeout:g} s")


class PayloadTooLarge(HTTPException):
    """Raised while FastAPI reads a body sent without Content-Length; its handlers turn it into a 413."""

    def __init__(self, limit: int):
        super().__init__(413, f"Payload too large: the limit is {limit} bytes")


async def _refuse(send, scope, status: int, message: str, kind: str) -> None:
    raw = json.dumps(error_body(is_openai(scope["path"]), status, message, kind)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]})
    await send({"type": "http.response.body", "body": raw})
