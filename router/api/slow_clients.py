"""Time limits on reading a request, so half-sent requests cannot pile up (uvicorn has none): its head must
arrive within HEAD_TIMEOUT s of the connection (or of the previous response on a kept-alive one), its body within
BODY_TIMEOUT s of the head (router/api/guards.py answers 408 past it)."""
import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_TIMEOUT = 10.0
BODY_TIMEOUT = 30.0


class TimedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection whose next request head is late: the keep-alive timer
    alone restarts with every byte, so a client dribbling a head one byte at a time held its connection forever."""

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._expect_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._expect_head()

    def _expect_head(self) -> None:
        waiting_after = self.cycle  # a new request head replaces the cycle
        self.loop.call_later(HEAD_TIMEOUT, self._head_late, waiting_after)

    def _head_late(self, waiting_after) -> None:
        if self.cycle is waiting_after and not self.transport.is_closing():
            self.transport.close()
