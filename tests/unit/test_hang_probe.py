"""A hung shard is found by the router's Health probes, in seconds, whatever the deadline; only served steps set
the deadline (router/shards.py, router/deadline.py). Driven with fake stubs: this is the router's own logic."""
import asyncio

import pytest

from proto import generate_pb2 as pb
from router import shards as shards_lib
from router.deadline import FACTOR, FLOOR, Deadline
from router.shards import ShardError, Shards


class Stub:
    """One rank: its step calls take `step_seconds` (None: never answer), Health answers unless `stopped`. Each
    call is a task, cancellable as a gRPC call is."""

    def __init__(self, step_seconds=0.0, stopped=False):
        self.step_seconds, self.stopped = step_seconds, stopped

    def __getattr__(self, method):
        return lambda request, timeout: asyncio.ensure_future(getattr(self, f"_{method}")(request, timeout))

    async def _Decode(self, request, timeout):
        if self.step_seconds is None:
            await asyncio.sleep(3600)
        await asyncio.sleep(self.step_seconds)
        return pb.StepResponse()

    async def _Warmup(self, request, timeout):
        await asyncio.sleep(self.step_seconds or 0)
        return pb.WarmupResponse(num_blocks=8)

    async def _Health(self, request, timeout):
        if self.stopped:
            await asyncio.sleep(timeout)
            raise FakeTimeout()
        return pb.HealthResponse()


class FakeTimeout(Exception):
    pass


def shards(*stubs: Stub) -> Shards:
    s = Shards.__new__(Shards)
    s.sockets, s.pids, s.deadline, s.stubs, s.channels = [], [], Deadline(60.0), list(stubs), []
    return s


@pytest.fixture(autouse=True)
def fast_probes(monkeypatch):
    monkeypatch.setattr(shards_lib, "HANG_PROBE_AFTER", 0.05)
    monkeypatch.setattr(shards_lib, "PROBE_TIMEOUT", 0.05)
    monkeypatch.setattr(shards_lib.grpc.aio, "AioRpcError", FakeTimeout)  # what a probe's timeout raises


def test_a_rank_that_stops_answering_health_fails_the_step_as_hung():
    s = shards(Stub(step_seconds=None), Stub(step_seconds=None, stopped=True))
    with pytest.raises(ShardError, match="hung") as caught:
        asyncio.run(asyncio.wait_for(s._all("Decode", pb.StepRequest()), 5))
    assert caught.value.missed_deadline  # the engine replaces the set rather than failing the step's requests


def test_a_slow_step_of_live_ranks_is_waited_for():
    s = shards(Stub(step_seconds=0.3), Stub(step_seconds=0.3))
    asyncio.run(s._all("Decode", pb.StepRequest()))
    assert s.deadline.slowest >= 0.3  # a served step moves the deadline


def test_only_served_steps_set_the_deadline():
    s = shards(Stub(step_seconds=0.2))
    asyncio.run(s.warmup(max_prefill_tokens=16))  # Warmup may compile for minutes: never a step's measure
    assert s.deadline.slowest == 0 and s.deadline.seconds == FLOOR
    asyncio.run(s._all("Decode", pb.StepRequest()))
    assert s.deadline.seconds == max(FLOOR, FACTOR * s.deadline.slowest)


def test_health_answers_keep_the_router_healthy_during_a_long_step():
    s = shards(Stub(step_seconds=0.4))
    s.deadline.last_answer -= 100  # silent for long before the step
    asyncio.run(s._all("Decode", pb.StepRequest()))
    assert s.deadline.silent_for < 1
