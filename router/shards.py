"""The router's client to the shards: every call goes to every rank at once; rank 0's answer is the answer.

This is where the scheduler's plans become the contract's messages (proto/generate.proto): a Step's entries,
its block moves and the tables the shards rebind. Every call has a deadline (router/deadline.py); one missed
counts as a shard failure. A call still running after HANG_PROBE_AFTER seconds is watched: every rank must keep
answering Health (a gRPC thread answers it while the main thread computes), and a rank that misses HANG_STRIKES
probes in a row is hung (stopped, or wedged), which fails the call in seconds, whatever the deadline.
"""
import asyncio
import time

import grpc

from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from router.core.step import Entry, Step
from router.deadline import Deadline

WARMUP_TIMEOUT = 600.0  # s: sizing the pools and a first prefill (and on a GPU compiling), on a cold machine
PROBE_TIMEOUT = 2.0     # s a live shard takes at most to answer Health (its gRPC threads answer it mid-step)
HANG_PROBE_AFTER = 2.0  # s a call runs before its ranks are probed, and between probes they answer
HANG_STRIKES = 2        # probes missed in a row that make a rank hung (one may be a loaded machine's hiccup)
STEP_CALLS = frozenset({"Prefill", "Decode", "FilterBatch", "Offload", "ClearCache"})  # their time sets the deadline


def target(address: str) -> str:
    """A rank's gRPC target: a unix socket's path, or host:port (a rank on another node)."""
    return f"unix://{address}" if address.startswith("/") else address


class ShardError(Exception):
    def __init__(self, message: str, missed_deadline: bool = False):
        super().__init__(message)
        self.missed_deadline = missed_deadline


class Shards:
    def __init__(self, sockets: list[str], timeout: float = 60.0):
        self.sockets = sockets
        self.deadline = Deadline(timeout)
        self.pids: list[int] = []  # each rank's process, from Info
        self._connect()

    def _connect(self) -> None:
        opts = [("grpc.max_receive_message_length", 256 * 2**20), ("grpc.max_send_message_length", 256 * 2**20)]
        self.channels = [grpc.aio.insecure_channel(target(s), options=opts) for s in self.sockets]
        self.stubs = [pb_grpc.ShardStub(c) for c in self.channels]

    async def reconnect(self) -> None:
        """Fresh channels for a new shard set (a long-lived channel backs off reconnecting, up to minutes)."""
        await self.close()
        self._connect()

    async def _every(self, method: str, request, timeout: float) -> list:
        calls = [getattr(stub, method)(request, timeout=timeout) for stub in self.stubs]
        started = time.monotonic()
        answers = asyncio.gather(*calls)
        answers.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved, even when given up on
        try:
            await self._watch(answers, method)
            answers = answers.result()
        except grpc.aio.AioRpcError as e:
            missed = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            raise ShardError(f"{method}: {e.code().name}: {e.details()}", missed) from e
        finally:
            for c in calls:
                c.cancel()
        self.deadline.answered(time.monotonic() - started, step=method in STEP_CALLS)
        return answers

    async def _watch(self, answers: asyncio.Future, method: str) -> None:
        """Waits for `answers`; from HANG_PROBE_AFTER s on, probes every rank's Health in between."""
        if method == "Health":
            await asyncio.wait({answers})
            return
        strikes = 0
        while not (await asyncio.wait({answers}, timeout=0 if strikes else HANG_PROBE_AFTER))[0]:
            strikes = 0 if await self.alive() else strikes + 1  # a missed probe is retried at once
            if strikes >= HANG_STRIKES:
                answers.cancel()
                raise ShardError(f"{method}: a shard missed {strikes} Health probes in a row while the call ran: "
                                 "it is hung", missed_deadline=True)

    async def _all(self, method: str, request):
        return (await self._every(method, request, self.deadline.seconds))[0]

    async def info(self) -> pb.InfoResponse:
        answers = await self._every("Info", pb.InfoRequest(), self.deadline.seconds)
        self.pids = [a.pid for a in answers]
        return answers[0]

    async def health(self) -> pb.HealthResponse:
        """Rank 0's Health (the compile's state): a probe, so a stopped shard fails it in PROBE_TIMEOUT s."""
        return (await self._every("Health", pb.HealthRequest(), PROBE_TIMEOUT))[0]

    async def alive(self) -> bool:
        """Whether every rank answers Health now (a failed call may have come from a live rank)."""
        async def one(stub) -> bool:
            try:
                await stub.Health(pb.HealthRequest(), timeout=PROBE_TIMEOUT)
                return True
            except grpc.aio.AioRpcError:
                return False
        if all(await asyncio.gather(*[one(stub) for stub in self.stubs])):
            self.deadline.answered(0.0, step=False)
            return True
        return False

    async def wait_until_up(self, interval: float = 0.2) -> None:
        """Until every rank answers: the router starts beside the shards, which take seconds to load."""
        while not await self.alive():
            await asyncio.sleep(interval)

    async def warmup(self, **sizing) -> pb.WarmupResponse:
        """Each shard sizes its own pools (WarmupRequest's fields); the usable pools are the smallest. Its time
        (a prefill of the largest step, and the pools' allocation) is the deadline's first measure."""
        request = pb.WarmupRequest(**sizing)
        answers = await self._every("Warmup", request, WARMUP_TIMEOUT)
        smallest = min(a.num_blocks for a in answers)
        if any(a.num_blocks != smallest for a in answers):
            request.num_blocks = smallest
            answers = await self._every("Warmup", request, WARMUP_TIMEOUT)
        slowest = [max(times, key=lambda t: t.seconds) for times in zip(*(a.step_times for a in answers))]
        return pb.WarmupResponse(num_blocks=smallest,
                                 num_window_blocks=min(a.num_window_blocks for a in answers),
                                 num_swap_blocks=min(a.num_swap_blocks for a in answers),
                                 compiled_sizes=answers[0].compiled_sizes,
                                 compile_seconds=max(a.compile_seconds for a in answers),
                                 step_times=slowest)  # a step ends when its slowest rank does

    async def offload(self, step: Step) -> None:
        await self._all("Offload", pb.OffloadRequest(
            to_cpu=[pb.BlockCopy(src=b, dst=s) for b, s in step.to_cpu],
            to_device=[pb.BlockCopy(src=s, dst=b) for s, b in step.to_device],
            tables=[pb.RequestBlocks(id=i, blocks=blocks) for i, blocks in step.tables.items()]))

    async def step(self, step: Step, jobs) -> pb.StepResponse:
        """Prefill when the step carries prompt tokens, else Decode; `jobs` gives each request's sampling
        parameters (sent with its first entry only: the shards keep them)."""
        entries = [entry_message(e, jobs[e.request.id]) for e in step.entries]
        return await self._all("Prefill" if step.has_prefill else "Decode", pb.StepRequest(entries=entries))

    async def filter(self, remove_ids: list[int]) -> None:
        await self._all("FilterBatch", pb.FilterBatchRequest(remove_ids=remove_ids))

    async def clear(self) -> None:
        await self._all("ClearCache", pb.ClearCacheRequest())

    async def close(self) -> None:
        await asyncio.gather(*[c.close() for c in self.channels])


def entry_message(e: Entry, job) -> pb.StepEntry:
    """One entry of a step as the shards receive it: only the new tokens and blocks, and for a constrained request
    that samples, the tokens its grammar allows next (computed here: it needs the token the last step gave)."""
    req = e.request
    allowed = job.constraint.allowed() if e.sample and job.constraint is not None else b""
    return pb.StepEntry(
        id=req.id, input_ids=e.input_ids, new_blocks=e.new_blocks, drafts=len(e.drafts),
        sample=e.sample, cached_tokens=e.start, parameters=job.parameters if e.first else None,
        prompt_tokens=len(req.prompt_ids) if e.first else 0,
        new_window_blocks=e.new_window_blocks, window_dropped=e.window_dropped, allowed_tokens=allowed,
    )
