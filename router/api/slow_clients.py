"""Time limits on reading a request, so half-sent requests cannot pile up (uvicorn has none): its head must
arrive within --request-head-timeout s of the connection (or of the previous response on a kept-alive one), its body
within --request-body-timeout s of the head (router/api/guards.py answers 408 past it)."""
import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


class TimedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection whose next request head is late: the keep-alive timer
    alone restarts with every byte, so a client dribbling a head one byte at a time held its connection forever."""
    head_timeout: float

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._expect_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._expect_head()

    def _expect_head(self) -> None:
        waiting_after = self.cycle  # a new request head replaces the cycle
        self.loop.call_later(self.head_timeout, self._head_late, waiting_after)

    def _head_late(self, waiting_after) -> None:
        if self.cycle is waiting_after and not self.transport.is_closing():
            self.transport.close()


def timed_protocol(head_timeout: float) -> type:
    """The protocol class uvicorn instantiates per connection, with its head timeout."""
    return type("TimedH11Protocol", (TimedH11Protocol,), {"head_timeout": head_timeout})
