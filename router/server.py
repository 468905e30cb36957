"""Starts the router: the HTTP app at once, then (in its lifespan) the shards warmed up, the KV pools sized and
the batching loop running; on SIGTERM/SIGINT it drains (503 for new work, in-flight requests finish) and exits 0."""
import asyncio
import contextlib
import gc
import logging
import os
import signal
import time
from pathlib import Path
from typing import Optional

from router.settings import Settings

log = logging.getLogger("router")
STREAM_CLOSE_TIMEOUT = 5.0  # s for responses to send their last bytes once draining is over


def serve(settings: Settings, model_dir: str, sockets: list[str]) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from router.api.guards import Guards
    from router.api.slow_clients import timed_protocol

    key = api_key(settings)
    svc = service(settings, model_dir)
    app = http_app(settings, svc, sockets)
    guarded = Guards(app, key, settings.payload_limit, settings.request_body_timeout)
    config = uvicorn.Config(guarded, host=settings.hostname, port=settings.port, log_level="warning",
                            http=timed_protocol(settings.request_head_timeout),
                            timeout_graceful_shutdown=STREAM_CLOSE_TIMEOUT)
    Server(config, svc, settings.graceful_timeout).run()


def api_key(settings: Settings) -> Optional[str]:
    """--api-key, or what --api-key-file holds: read here, at start-up, so a key kept in a file (a mounted secret)
    never enters an environment or a command line. ValueError when both are given, or the file is unreadable or
    empty (an empty key would silently leave every route open)."""
    if settings.api_key_file is None:
        return settings.api_key
    if settings.api_key is not None:
        raise ValueError("--api-key and --api-key-file (API_KEY, API_KEY_FILE) are both given: keep one")
    try:
        key = Path(settings.api_key_file).read_text().strip()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--api-key-file {settings.api_key_file}: cannot read it ({error})") from None
    if not key:
        raise ValueError(f"--api-key-file {settings.api_key_file} is empty")
    return key


def service(settings: Settings, model_dir: str):
    """What the routes share: the tokenizer, the stop tokens, the limits; the engine joins at start-up."""
    from transformers import AutoTokenizer, GenerationConfig

    from router.api.service import Service
    from router.api.validation import Limits
    from router.grammar import Grammars

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    gen = GenerationConfig.from_pretrained(model_dir)
    eos = gen.eos_token_id if gen.eos_token_id is not None else tokenizer.eos_token_id
    limits = Limits(settings.max_input_tokens, settings.max_total_tokens, len(tokenizer),
                    settings.max_stop_sequences, settings.max_top_n_tokens)
    eos_ids = frozenset([eos] if isinstance(eos, int) else eos)
    return Service(tokenizer, limits, eos_ids, settings.max_concurrent_requests, settings.model_name,
                   grammars=Grammars(tokenizer, len(tokenizer), eos_ids))


def http_app(settings: Settings, svc, sockets: list[str]):
    from fastapi import FastAPI

    from router.api.errors import install_error_handlers
    from router.api.openai import install_openai_routes
    from router.api.tgi import install_tgi_routes
    from router.shards import Shards

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        shards = Shards(sockets, settings.shard_timeout)
        svc.engine, svc.info = await start_engine(settings, shards)
        gc.freeze()  # start-up's objects (transformers, the tokenizer) are permanent: full collections skip them
        loop_task = asyncio.create_task(svc.engine.run())
        yield
        loop_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop_task
        await shards.close()

    app = FastAPI(title="cb", lifespan=lifespan)
    install_error_handlers(app)
    install_tgi_routes(app, svc)
    install_openai_routes(app, svc)
    return app


async def start_engine(s: Settings, shards):
    """Warms the shards up, sizes the pools (the smallest any shard can hold) and builds the scheduler."""
    from router.api.info import Info
    from router.core.allocator import ceil_div
    from router.core.kv import KVManager
    from router.core.pacing import pacer
    from router.core.scheduler import Budget, Scheduler
    from router.core.speculation import Speculator
    from router.engine import Engine
    from router.recovery import Recovery
    from router.trace import Trace

    began = time.monotonic()
    await shards.wait_until_up()
    loaded = time.monotonic()
    log.info("the shards answer (%.1f s after the router started waiting for them)", loaded - began)
    info = await shards.info()
    window = info.sliding_window if info.num_window_layers else 0
    swap_bytes = int(s.cpu_offload_space * 2**30) if KVManager.can_offload_model(window) else 0
    wanted = s.num_blocks or (ceil_div(s.max_batch_total_tokens, s.block_size) if s.max_batch_total_tokens else 0)
    sizing = dict(max_prefill_tokens=s.max_batch_prefill_tokens, max_batch_size=s.max_batch_size,
                  num_blocks=wanted, max_memory_fraction=s.max_memory_percent, max_total_tokens=s.max_total_tokens,
                  cpu_swap_bytes=swap_bytes)
    pools = await shards.warmup(**sizing, time_steps=s.prefill_step_ratio > 0)  # a replacement set needs none
    log.info("warmed up in %.1f s: pools sized%s", time.monotonic() - loaded,
             f", step sizes compiled in {pools.compile_seconds:.1f} s" if pools.compiled_sizes else "")
    total = check_capacity(s, pools.num_blocks)
    kv = KVManager(pools.num_blocks, s.block_size, s.prefix_caching, pools.num_swap_blocks, window,
                   pools.num_window_blocks)
    log_pools(s, info, kv)
    budget = Budget(s.max_batch_prefill_tokens, total, s.max_batch_size, s.waiting_served_ratio,
                    s.max_waiting_tokens)
    trace = Trace(open(s.trace_file, "w") if s.trace_file else None)
    step_times = [(t.decodes, t.chunk_start, t.chunk_tokens, t.seconds) for t in pools.step_times]
    trace.calibration = step_times
    paced = pacer(s.prefill_step_ratio)
    if paced is not None:  # the cost model starts from the steps the shards timed, not from nothing
        paced.calibrate(step_times)
        fixed, per_token, _ = paced.prompt_cost() or (0.0, 0.0, 0.0)
        log.info("step cost model from Warmup: decode-only steps of 1 / 64 requests %.1f / %.1f ms; a prompt chunk "
                 "adds %.1f ms and %.2f ms a token", 1e3 * (paced.decode_step(1) or 0),
                 1e3 * (paced.decode_step(64) or 0), 1e3 * fixed, 1e3 * per_token)
    speculator = Speculator(s.speculate) if s.speculate else None
    if speculator is not None and kv.window is not None:
        log.warning("--speculate %d is off: a sliding-window model's window table cannot take drafts back", s.speculate)
    engine = Engine(shards, Scheduler(budget, kv, s.scheduler, s.margin, paced, speculator), trace,
                    Recovery(shards, sizing, pools))
    return engine, Info(
        model_id=s.model_name, model_dtype=info.dtype, model_device_type=info.device,
        quantize=info.quantize or None, num_shard=info.world_size,
        max_input_tokens=s.max_input_tokens, max_total_tokens=s.max_total_tokens, max_batch_total_tokens=total,
        max_batch_prefill_tokens=s.max_batch_prefill_tokens, max_batch_size=s.max_batch_size,
        waiting_served_ratio=s.waiting_served_ratio, max_waiting_tokens=s.max_waiting_tokens,
        max_concurrent_requests=s.max_concurrent_requests, block_size=s.block_size, num_blocks=kv.pool.num_blocks,
        num_swap_blocks=kv.swap.num_blocks if kv.swap else 0,
        num_window_blocks=kv.window.blocks.num_blocks if kv.window else 0, scheduler=s.scheduler,
        safety_margin=s.margin, prefill_step_ratio=s.prefill_step_ratio, prefix_caching=kv.prefix_caching,
        compiled_step_sizes=list(pools.compiled_sizes), compile_seconds=round(pools.compile_seconds, 1),
        compile_state="ready" if pools.compiled_sizes else "pending",  # /info asks the shards until it is over
        max_stop_sequences=s.max_stop_sequences, max_top_n_tokens=s.max_top_n_tokens,
        speculate=s.speculate if speculator is not None and kv.window is None else 0)


def check_capacity(s: Settings, num_blocks: int) -> int:
    """The batch's token budget; refuses to start when one request of --max-total-tokens cannot fit."""
    capacity = num_blocks * s.block_size
    total = min(s.max_batch_total_tokens or capacity, capacity)
    if s.max_total_tokens > total:
        message = (f"--max-total-tokens {s.max_total_tokens} does not fit in the KV cache ({total} tokens): lower "
                   "--max-total-tokens or raise --max-batch-total-tokens / --num-blocks / --max-memory-percent")
        log.error(message)
        raise RuntimeError(message)
    log.info("KV cache: %d blocks x %d tokens = %d tokens, room for %d requests of --max-total-tokens",
             num_blocks, s.block_size, capacity, capacity // s.max_total_tokens)
    return total


def log_pools(s: Settings, info, kv) -> None:
    if kv.window is not None:
        log.info("sliding-window layers: %d of %d, window %d, their own pool of %d blocks", info.num_window_layers,
                 info.num_layers, kv.window.window, kv.window.blocks.num_blocks)
    swap = f"to {kv.swap.num_blocks} host blocks" if kv.swap else "off (soft reset)"
    log.info("prefix caching %s; scheduler %s, safety margin %.2f; offload %s",
             "on" if kv.prefix_caching else "off", s.scheduler, s.margin, swap)


class Server:
    """uvicorn, draining on SIGTERM/SIGINT: the HTTP server keeps answering (503 for new work and for /health)
    while the requests in flight finish; those still running at --graceful-timeout end with an error event; then
    it stops and the process exits 0. A second signal stops at once."""

    def __init__(self, config, svc, graceful_timeout: float):
        import uvicorn

        self.svc = svc
        self.graceful_timeout = graceful_timeout
        self.server = uvicorn.Server(config)
        self.server.capture_signals = self.capture_signals

    @contextlib.contextmanager
    def capture_signals(self):
        handlers = {sig: signal.signal(sig, self.on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def on_signal(self, sig, frame) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if self.svc.draining or self.svc.engine is None or loop is None:
            self.server.handle_exit(sig, frame)
            return
        self.svc.draining = True
        loop.call_soon_threadsafe(lambda: loop.create_task(self.drain(signal.Signals(sig).name)))

    async def drain(self, name: str) -> None:
        engine = self.svc.engine
        log.info("%s: draining; %d request(s) in flight get up to %.0f s to finish", name, len(engine.jobs),
                 self.graceful_timeout)
        if engine.recovering:  # the launcher gave up on the shards, or stops us while they restart
            engine.end_all("the server is stopping while its shards are being replaced")
        give_up = time.monotonic() + self.graceful_timeout
        while engine.jobs and time.monotonic() < give_up:
            await asyncio.sleep(0.1)
        if engine.jobs:
            log.warning("graceful timeout: ending %d request(s) still in flight", len(engine.jobs))
            engine.end_all("the server is shutting down: --graceful-timeout reached")
        self.server.should_exit = True

    def run(self) -> None:
        self.server.run()
        if not self.server.started:  # the lifespan failed (its reason is logged): not a clean stop
            raise SystemExit(3)
