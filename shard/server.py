"""The gRPC service of one rank. Every rank receives the same calls in the same order (the router awaits all
ranks before the next call), so the collectives inside a forward pass line up; rank 0's answer is used.
"""
import logging
import os
import time
from concurrent import futures

import grpc
import torch

from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from shard.kv_cache import bytes_per_block, free_memory
from shard.model import LoadedModel
from shard.runner import Runner, StepError
from shard.swap import SwapPool

log = logging.getLogger("shard")


class ShardService(pb_grpc.ShardServicer):
    def __init__(self, loaded: LoadedModel, runner: Runner, world: int, dtype: str):
        self.loaded = loaded
        self.runner = runner
        self.world = world
        self.dtype = dtype
        self.swap: SwapPool | None = None

    def Info(self, request, context):
        m = self.loaded
        return pb.InfoResponse(
            model_type=m.config.model_type, dtype=self.dtype, device=str(self.runner.device),
            world_size=self.world, block_size=self.runner.block_size, num_layers=m.num_layers,
            num_kv_heads=m.kv_heads, head_dim=m.head_dim, vocab_size=m.config.vocab_size,
            max_position_embeddings=getattr(m.config, "max_position_embeddings", 0) or 0,
            sliding_window=m.sliding_window, num_window_layers=sum(m.sliding),
        )

    def Health(self, request, context):
        return pb.HealthResponse()

    def Warmup(self, request, context):
        r, m = self.runner, self.loaded
        r.warmup(max(request.max_prefill_tokens, 1))
        window_layers = sum(m.sliding)
        per_block = bytes_per_block(m.num_layers - window_layers, r.block_size, m.kv_heads, m.head_dim,
                                    m.model.dtype)
        per_window_block = bytes_per_block(window_layers, r.block_size, m.kv_heads, m.head_dim, m.model.dtype)
        # The window pool is sized so that it never runs out. In a step computing n of its tokens, a request's
        # window table spans from its oldest visible key (first query - window + 1) to its newest token: at most
        # ceil((window - 1) / bs) + 1 + ceil((n - 1) / bs) blocks, and over the batch the last terms add up to at
        # most ceil(max_prefill_tokens / bs) + max_batch_size. Nor can it need more blocks than the full pool
        # has: a window table holds a subset of the same request's blocks.
        most_window = 0
        if window_layers:
            most_window = (request.max_batch_size * (-(-(m.sliding_window - 1) // r.block_size) + 2)
                           + -(-max(request.max_prefill_tokens, 1) // r.block_size))
        num_blocks = request.num_blocks
        if not num_blocks:
            local_world = self.world if r.device.type == "cpu" else 1
            budget = free_memory(r.device, local_world) * (request.max_memory_fraction or 0.9)
            if r.device.type == "cpu" and not window_layers:  # the swap pool (at most the pool's size) shares it
                budget -= min(request.cpu_swap_bytes, budget / 2)
            fit = int((budget - most_window * per_window_block) // per_block)
            if fit < most_window:  # too little memory for both: pools of equal size
                fit = int(budget // (per_block + per_window_block))
            most_ever = request.max_batch_size * -(-request.max_total_tokens // r.block_size)
            num_blocks = min(fit, most_ever or fit)
        num_window_blocks = min(most_window, num_blocks)
        if num_blocks < 1:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no memory left for a single KV block")
        r.allocate(num_blocks, num_window_blocks)
        log.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, r.block_size,
                 num_blocks * per_block / 2**20)
        if num_window_blocks:
            log.info("sliding-window layers' KV cache: %d blocks (%.1f MiB)", num_window_blocks,
                     num_window_blocks * per_window_block / 2**20)
        # At most the device pool's size: room for any request, and host memory is not the KV cache's twin.
        # Hybrid models get none: their eviction is a soft reset (the router offloads full-pool blocks only).
        swap_slots = 0 if num_window_blocks else min(request.cpu_swap_bytes // per_block, num_blocks)
        self.swap = SwapPool(r.cache.full, swap_slots) if swap_slots else None
        if self.swap:
            log.info("swap pool: %d blocks (%.1f MiB of host memory)", swap_slots, swap_slots * per_block / 2**20)
        return pb.WarmupResponse(num_blocks=num_blocks, num_window_blocks=num_window_blocks,
                                 num_swap_blocks=swap_slots)

    def _step(self, request, context):
        try:
            generations, prefill, ns = self.runner.step(request.entries)
        except StepError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        tokens = sum(len(e.input_ids) for e in request.entries)
        return pb.StepResponse(generations=generations, prefill=prefill, forward_ns=ns, tokens=tokens)

    Prefill = _step
    Decode = _step

    def FilterBatch(self, request, context):
        self.runner.filter(request.remove_ids)
        return pb.FilterBatchResponse()

    def ClearCache(self, request, context):
        self.runner.clear()
        return pb.ClearCacheResponse()

    def Offload(self, request, context):
        """Device -> host first (a freed block may be a restore's target), then host -> device, then the
        block tables of the requests involved."""
        if self.swap is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this shard has no swap pool")
        pool = self.runner.cache.full
        start = time.perf_counter()
        self.swap.offload(pool, [c.src for c in request.to_cpu], [c.dst for c in request.to_cpu])
        self.swap.restore(pool, [c.src for c in request.to_device], [c.dst for c in request.to_device])
        if pool.is_cuda:
            torch.cuda.synchronize(pool.device)
        try:
            for table in request.tables:
                self.runner.rebind(table.id, list(table.blocks))
        except StepError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        log.debug("offload: %d blocks out, %d in, %.1f ms", len(request.to_cpu), len(request.to_device),
                  (time.perf_counter() - start) * 1e3)
        return pb.OffloadResponse()


def serve(service: ShardService, uds: str) -> grpc.Server:
    """One worker thread: calls are strictly ordered, and torch's thread pool stays bound to one caller (a
    second calling thread would start a second OpenMP team competing for the same cores). The socket is
    created owner-only (umask), not chmodded after the fact."""
    if os.path.exists(uds):
        os.unlink(uds)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1), options=[
        ("grpc.max_receive_message_length", 256 * 2**20), ("grpc.max_send_message_length", 256 * 2**20),
    ])
    pb_grpc.add_ShardServicer_to_server(service, server)
    old_umask = os.umask(0o177)
    try:
        server.add_insecure_port(f"unix://{uds}")
        server.start()
    finally:
        os.umask(old_umask)
    return server


def pick_device(name: str, rank: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")
