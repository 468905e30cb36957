"""The router's client to the shards: every call goes to every rank at once; rank 0's answer is the answer."""
import asyncio

import grpc

from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc


class ShardError(Exception):
    pass


class Shards:
    def __init__(self, sockets: list[str]):
        opts = [("grpc.max_receive_message_length", 256 * 2**20), ("grpc.max_send_message_length", 256 * 2**20)]
        self.channels = [grpc.aio.insecure_channel(f"unix://{s}", options=opts) for s in sockets]
        self.stubs = [pb_grpc.ShardStub(c) for c in self.channels]

    async def _all(self, method: str, request):
        calls = [getattr(stub, method)(request) for stub in self.stubs]
        try:
            answers = await asyncio.gather(*calls)
        except grpc.aio.AioRpcError as e:
            for c in calls:
                c.cancel()
            raise ShardError(f"{method}: {e.code().name}: {e.details()}") from e
        return answers[0]

    async def info(self) -> pb.InfoResponse:
        return await self._all("Info", pb.InfoRequest())

    async def health(self) -> None:
        await self._all("Health", pb.HealthRequest())

    async def warmup(self, request: pb.WarmupRequest) -> pb.WarmupResponse:
        """Each shard sizes its own pools; the usable pools are the smallest of them."""
        answers = await asyncio.gather(*[stub.Warmup(request) for stub in self.stubs])
        smallest = min(a.num_blocks for a in answers)
        if any(a.num_blocks != smallest for a in answers):
            request.num_blocks = smallest
            answers = await asyncio.gather(*[stub.Warmup(request) for stub in self.stubs])
        return pb.WarmupResponse(num_blocks=smallest,
                                 num_window_blocks=min(a.num_window_blocks for a in answers),
                                 num_swap_blocks=min(a.num_swap_blocks for a in answers))

    async def offload(self, request: pb.OffloadRequest) -> None:
        await self._all("Offload", request)

    async def step(self, prefill: bool, entries: list[pb.StepEntry]) -> pb.StepResponse:
        return await self._all("Prefill" if prefill else "Decode", pb.StepRequest(entries=entries))

    async def filter(self, remove_ids: list[int]) -> None:
        await self._all("FilterBatch", pb.FilterBatchRequest(remove_ids=remove_ids))

    async def clear(self) -> None:
        await self._all("ClearCache", pb.ClearCacheRequest())

    async def close(self) -> None:
        await asyncio.gather(*[c.close() for c in self.channels])
