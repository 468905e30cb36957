"""The gRPC service of one rank. Every rank receives the same calls in the same order (the router awaits all
ranks before the next call), so the collectives inside a forward pass line up; rank 0's answer is used.
"""
import gc
import logging
import os
import time
from concurrent import futures
from typing import Optional

import grpc
import torch

from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from shard import calibration
from shard.compiling import Compiling
from shard.kv_cache import size_pools
from shard.main_thread import MainThread, on_main_thread
from shard.model import LoadedModel
from shard.runner import Runner, StepError
from shard.sampling import Params
from shard.step import Entry
from shard.swap import SwapPool

log = logging.getLogger("shard")


class ShardService(pb_grpc.ShardServicer):
    def __init__(self, loaded: LoadedModel, runner: Runner, world: int, main: Optional[MainThread] = None):
        self.main = main  # where torch runs (see main_thread.py); None: in the calling thread
        self.loaded = loaded
        self.runner = runner
        self.world = world
        self.swap: SwapPool | None = None
        self.compiling = Compiling(runner, main, world)
        self.step_times: Optional[list] = None  # timed at the first Warmup (calibration.py)

    def Info(self, request, context):
        m = self.loaded
        return pb.InfoResponse(
            model_type=m.config.model_type, dtype=m.dtype_name, device=str(self.runner.device),
            world_size=self.world, block_size=self.runner.block_size, num_layers=m.num_layers,
            num_kv_heads=m.kv_heads, head_dim=m.head_dim, vocab_size=m.config.vocab_size,
            max_position_embeddings=getattr(m.config, "max_position_embeddings", 0) or 0,
            sliding_window=m.sliding_window, num_window_layers=sum(m.sliding),
            quantize=m.quantize or "", pid=os.getpid(),
        )

    def Health(self, request, context):
        """Answered by a gRPC thread, also while the main thread runs a step: a shard that does not answer is hung."""
        c = self.compiling
        return pb.HealthResponse(compile_state=c.state, compiled_sizes=c.sizes, compile_seconds=c.seconds)

    @on_main_thread
    def Warmup(self, request, context):
        """Sizes the pools after one eager step at the largest size, and times steps for the router's cost model
        when asked (a server's start, not a replacement set); the step sizes compile here first where they must
        (CUDA graphs: their memory is then counted), else in the background once the pools exist."""
        r, m = self.runner, self.loaded
        r.warmup(max(request.max_prefill_tokens, 1))
        if request.time_steps and self.step_times is None:
            self.step_times = calibration.time_steps(r, max(request.max_prefill_tokens, 1),
                                                     max(request.max_batch_size, 1))
        if not self.compiling.background:
            self.compiling.start()
        sizes = size_pools(m.sliding, m.sliding_window, r.block_size, m.kv_heads, m.head_dim, m.dtype,
                           r.device, self.world, num_blocks=request.num_blocks,
                           max_prefill_tokens=request.max_prefill_tokens, max_batch_size=request.max_batch_size,
                           max_total_tokens=request.max_total_tokens, memory_fraction=request.max_memory_fraction,
                           swap_bytes=request.cpu_swap_bytes)
        if sizes.num_blocks < 1:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no memory left for a single KV block")
        r.allocate(sizes.num_blocks, sizes.num_window_blocks)
        log.info("KV cache: %d blocks of %d tokens (%.1f MiB)", sizes.num_blocks, r.block_size,
                 sizes.num_blocks * sizes.bytes_per_block / 2**20)
        if sizes.num_window_blocks:
            log.info("sliding-window layers' KV cache: %d blocks (%.1f MiB)", sizes.num_window_blocks,
                     sizes.num_window_blocks * sizes.bytes_per_window_block / 2**20)
        self.swap = SwapPool(r.cache.full, sizes.num_swap_blocks) if sizes.num_swap_blocks else None
        if self.swap:
            log.info("swap pool: %d blocks (%.1f MiB of host memory)", sizes.num_swap_blocks,
                     sizes.num_swap_blocks * sizes.bytes_per_block / 2**20)
        # Everything made so far (torch's and transformers' objects, the model) lives as long as the process: frozen,
        # the collector's full passes skip it. Unfrozen, each took 160-320 ms here, stalling the step it fell in.
        gc.freeze()
        self.compiling.start()
        return pb.WarmupResponse(num_blocks=sizes.num_blocks, num_window_blocks=sizes.num_window_blocks,
                                 num_swap_blocks=sizes.num_swap_blocks, compiled_sizes=self.compiling.sizes,
                                 compile_seconds=self.compiling.seconds,
                                 step_times=[pb.StepTime(decodes=d, chunk_start=s, chunk_tokens=n, seconds=t)
                                             for d, s, n, t in self.step_times or []])

    @on_main_thread
    def _step(self, request, context):
        try:
            result = self.runner.step([step_entry(e) for e in request.entries])
        except StepError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return pb.StepResponse(
            generations=[pb.Generation(id=g.id, token_id=g.token_id, logprob=g.logprob,
                                       top_tokens=[pb.TopToken(token_id=t, logprob=v) for t, v in g.top],
                                       more_tokens=[t for t, _ in g.more], more_logprobs=[v for _, v in g.more])
                         for g in result.generations],
            prefill=[pb.PrefillLogprobs(id=i, logprobs=lps) for i, lps in result.prefill],
            forward_ns=result.forward_ns, tokens=sum(len(e.input_ids) for e in request.entries),
            compiled=result.compiled)

    Prefill = _step
    Decode = _step

    @on_main_thread
    def FilterBatch(self, request, context):
        self.runner.filter(request.remove_ids)
        return pb.FilterBatchResponse()

    @on_main_thread
    def ClearCache(self, request, context):
        self.runner.clear()
        return pb.ClearCacheResponse()

    @on_main_thread
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


def step_entry(e: pb.StepEntry) -> Entry:
    """A gRPC step entry as the runner takes it."""
    first = e.HasField("parameters")
    p = e.parameters
    params = Params(p.temperature or 1.0, p.top_k, p.top_p or 1.0, p.do_sample, p.seed, p.repetition_penalty or 1.0,
                    p.frequency_penalty, p.typical_p or 1.0, p.top_n_tokens) if first else None
    return Entry(e.id, list(e.input_ids), list(e.new_blocks), e.sample, e.cached_tokens, params, e.prompt_tokens,
                 first and p.prefill_logprobs, list(e.new_window_blocks), e.window_dropped, e.allowed_tokens,
                 e.drafts)


def serve(service: ShardService, where: str) -> tuple[grpc.Server, str]:
    """Serves on a unix socket path, or on host:port (port 0: one the system picks); returns the server and the
    address it serves on. Calls are strictly ordered: the router sends the next only once every rank answered, and
    their torch work goes on to the service's MainThread. A second worker answers Health while a step runs (the
    router's hang probe). The socket is created owner-only (umask), not chmodded after the fact."""
    tcp = not where.startswith("/")
    if not tcp and os.path.exists(where):
        os.unlink(where)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=[
        ("grpc.max_receive_message_length", 256 * 2**20), ("grpc.max_send_message_length", 256 * 2**20),
    ])
    pb_grpc.add_ShardServicer_to_server(service, server)
    old_umask = os.umask(0o177)
    try:
        port = server.add_insecure_port(where if tcp else f"unix://{where}")
        server.start()
    finally:
        os.umask(old_umask)
    return server, f"{where.rpartition(':')[0]}:{port}" if tcp else where


def pick_device(name: str, rank: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")
