"""`python -m router`: warm the shards up, size the KV pool, then serve HTTP and run the batching loop."""
import asyncio
import contextlib
import logging
import os
from typing import Optional

import typer

app = typer.Typer(add_completion=False)
log = logging.getLogger("router")


@app.command()
def main(
    model_dir: str = typer.Option(...),
    uds: str = typer.Option(..., help="comma-separated shard sockets, rank 0 first"),
    hostname: str = "127.0.0.1",
    port: int = 8080,
    max_concurrent_requests: int = 128,
    max_input_tokens: int = 1024,
    max_total_tokens: int = 2048,
    max_batch_prefill_tokens: int = 512,
    max_batch_total_tokens: Optional[int] = None,
    max_batch_size: int = 64,
    waiting_served_ratio: float = 0.3,
    max_waiting_tokens: int = 20,
    block_size: int = 16,
    max_memory_percent: float = 0.9,
    graceful_timeout: float = 30.0,
    trace_file: Optional[str] = typer.Option(None, help="write every scheduling decision here (JSON lines)"),
    api_key: Optional[str] = typer.Option(None, envvar="API_KEY",
                                          help="require `Authorization: Bearer KEY` (not on /health, /metrics, /info)"),
    payload_limit: int = typer.Option(2_000_000, help="largest request body in bytes (413 beyond)"),
    max_stop_sequences: int = 4,
    max_top_n_tokens: int = 5,
    prefix_caching: bool = typer.Option(True, help="share the KV blocks of common prompt prefixes"),
    num_blocks: Optional[int] = typer.Option(None, help="KV blocks in the pool (default: from the budget or memory)"),
    scheduler: str = typer.Option("fifo", help="fifo or prefill_first"),
    safety_margin: Optional[float] = typer.Option(None, help="default: fifo 0.15, prefill_first 0"),
    cpu_offload_space: float = typer.Option(4.0, help="GiB of host memory per shard for offloaded KV blocks"),
):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn
    from fastapi import FastAPI
    from transformers import AutoTokenizer, GenerationConfig

    from proto import generate_pb2 as pb
    from router.block_table import BlockTable
    from router.engine import Engine
    from router.scheduler import DEFAULT_SAFETY_MARGIN, POLICIES, Budget, Scheduler
    from router.window import WindowTable
    from router.guards import Guards
    from router.server import install_routes
    from router.service import Service
    from router.shards import Shards
    from router.trace import Trace
    from router.validation import Limits

    if scheduler not in POLICIES:
        raise typer.BadParameter(f"--scheduler must be one of {', '.join(POLICIES)}")
    margin = DEFAULT_SAFETY_MARGIN[scheduler] if safety_margin is None else safety_margin
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    gen_cfg = GenerationConfig.from_pretrained(model_dir)
    eos = gen_cfg.eos_token_id if gen_cfg.eos_token_id is not None else tokenizer.eos_token_id
    eos_ids = frozenset([eos] if isinstance(eos, int) else eos)

    @contextlib.asynccontextmanager
    async def lifespan(fastapi_app: FastAPI):
        shards = Shards(uds.split(","))
        await shards.health()
        info = await shards.info()
        wanted = num_blocks or (-(-max_batch_total_tokens // block_size) if max_batch_total_tokens else 0)
        pools = await shards.warmup(pb.WarmupRequest(
            max_prefill_tokens=max_batch_prefill_tokens, max_batch_size=max_batch_size, num_blocks=wanted,
            max_memory_fraction=max_memory_percent, max_total_tokens=max_total_tokens,
            cpu_swap_bytes=int(cpu_offload_space * 2**30)))
        blocks = pools.num_blocks
        capacity = blocks * block_size
        total_budget = min(max_batch_total_tokens or capacity, capacity)
        if max_total_tokens > total_budget:
            message = (f"--max-total-tokens {max_total_tokens} does not fit in the KV cache ({total_budget} "
                       f"tokens): lower --max-total-tokens or raise --max-batch-total-tokens / --num-blocks / "
                       "--max-memory-percent")
            log.error(message)
            raise RuntimeError(message)
        log.info("KV cache: %d blocks x %d tokens = %d tokens, room for %d requests of --max-total-tokens",
                 blocks, block_size, capacity, capacity // max_total_tokens)
        budget = Budget(max_batch_prefill_tokens, total_budget, max_batch_size, waiting_served_ratio,
                        max_waiting_tokens)
        trace = Trace(open(trace_file, "w") if trace_file else None)
        share = prefix_caching and not info.num_window_layers  # window layers keep no prefix to share
        window = None
        if info.num_window_layers and pools.num_window_blocks:
            window = WindowTable(BlockTable(pools.num_window_blocks, block_size), info.sliding_window)
            log.info("sliding-window layers: %d of %d, window %d, their own pool of %d blocks",
                     info.num_window_layers, info.num_layers, info.sliding_window, pools.num_window_blocks)
        swap = BlockTable(pools.num_swap_blocks, block_size) if pools.num_swap_blocks and not window else None
        log.info("prefix caching %s; scheduler %s, safety margin %.2f; offload %s", "on" if share else "off",
                 scheduler, margin, f"to {pools.num_swap_blocks} host blocks" if swap else "off (soft reset)")
        engine = Engine(shards, Scheduler(budget, BlockTable(blocks, block_size, share), scheduler, margin,
                                          swap, window), trace)
        svc.engine = engine
        svc.info.update({
            "model_id": model_dir, "model_dtype": info.dtype, "model_device_type": info.device,
            "num_shard": info.world_size, "max_input_tokens": max_input_tokens,
            "max_total_tokens": max_total_tokens, "max_batch_total_tokens": total_budget,
            "max_batch_prefill_tokens": max_batch_prefill_tokens, "max_batch_size": max_batch_size,
            "waiting_served_ratio": waiting_served_ratio, "max_waiting_tokens": max_waiting_tokens,
            "max_concurrent_requests": max_concurrent_requests, "block_size": block_size,
            "num_blocks": blocks, "num_swap_blocks": swap.num_blocks if swap else 0,
            "num_window_blocks": window.blocks.num_blocks if window else 0, "scheduler": scheduler,
            "safety_margin": margin, "router": "cb-router", "version": "0.1.0", "model_sha": None,
            "model_pipeline_tag": "text-generation", "max_best_of": 1, "max_stop_sequences": max_stop_sequences,
            "max_top_n_tokens": max_top_n_tokens, "validation_workers": 1, "max_client_batch_size": 1,
            "sha": None, "docker_label": None,
        })
        loop_task = asyncio.create_task(engine.run())
        yield
        loop_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop_task
        await shards.close()

    limits = Limits(max_input_tokens, max_total_tokens, len(tokenizer), max_stop_sequences, max_top_n_tokens)
    svc = Service(None, tokenizer, limits, eos_ids, max_concurrent_requests)
    fastapi_app = FastAPI(title="cb", lifespan=lifespan)
    install_routes(fastapi_app, svc)
    config = uvicorn.Config(Guards(fastapi_app, api_key, payload_limit), host=hostname, port=port, log_level="warning",
                            timeout_graceful_shutdown=graceful_timeout)
    server = uvicorn.Server(config)
    original = server.handle_exit

    def drain(sig, frame):
        svc.draining = True
        original(sig, frame)

    server.handle_exit = drain
    server.run()


if __name__ == "__main__":
    app()
