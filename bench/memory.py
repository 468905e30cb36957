"""Memory benchmarks (`python -m bench.memory`, `make bench-memory`), numbers for the notes, never test thresholds.

concurrency: W64 against a live server with a small fixed pool; the peak of running requests with on-demand
  block allocation (measured, polling /metrics) vs reserving each request's whole lifetime (prompt plus
  max_new_tokens) up front, as TGI does (the same arrivals replayed through a reservation model of the pool).
prefix: TTFT of a request whose 1,024-token prefix is cached vs the same request cold (random token ids, an
  8-token suffix, one new token; median over a few prefixes).
offload: on one shard in-process, the time to offload and restore N blocks (one batched copy each way) vs the
  time to recompute them (a prefill of N * block_size tokens).
"""
from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path
from typing import Optional

import httpx
import typer

from bench.client import run as run_workload
from bench.server import free_port, launch_server, stop_server
from bench.workloads import load_w64
from router.core.allocator import ceil_div
from router.settings import Settings

DEFAULTS = Settings()

app = typer.Typer(add_completion=False, rich_markup_mode=None)


def reserved_peak(reqs, num_blocks: int, block_size: int, max_batch_size: int) -> int:
    """All requests queued at once, FIFO; a request is admitted only when blocks for its whole lifetime are
    free and holds them until it ends; one token per running request per step. Returns the peak running."""
    need = [ceil_div(r.prompt_tokens + r.max_new_tokens, block_size) for r in reqs]
    queue, running, free, peak = list(range(len(reqs))), {}, num_blocks, 0
    while queue or running:
        while queue and len(running) < max_batch_size and need[queue[0]] <= free:
            i = queue.pop(0)
            free -= need[i]
            running[i] = reqs[i].max_new_tokens
        peak = max(peak, len(running))
        for i in list(running):
            running[i] -= 1
            if running[i] == 0:
                free += need[i]
                del running[i]
    return peak


def _poll_peak(url: str, stop: threading.Event, out: list) -> None:
    from prometheus_client.parser import text_string_to_metric_families
    while not stop.is_set():
        try:
            text = httpx.get(f"{url}/metrics", timeout=5).text
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    if s.name in ("tgi_batch_current_size", "cb_offloaded_requests", "cb_offloads_total",
                                  "cb_preemptions_total"):
                        out.append((s.name, s.value))
        except httpx.HTTPError:
            pass
        time.sleep(0.05)


@app.command()
def concurrency(num_blocks: int = 160, block_size: int = DEFAULTS.block_size, dtype: str = DEFAULTS.dtype,
                launcher_args: str = "", out: Optional[Path] = None):
    reqs = load_w64()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = launch_server(port, dtype, ["--num-blocks", str(num_blocks), "--block-size", str(block_size),
                                       "--max-input-tokens", "256", "--max-total-tokens", "512",
                                       *launcher_args.split()], url)
    try:
        info = httpx.get(f"{url}/info", timeout=10).json()
        samples: list = []
        stop = threading.Event()
        poller = threading.Thread(target=_poll_peak, args=(url, stop, samples), daemon=True)
        poller.start()
        start = time.monotonic()
        records, _ = run_workload(url, reqs, progress=False)
        wall = time.monotonic() - start
        stop.set()
        poller.join()
    finally:
        stop_server(proc)
    peak = max(v for n, v in samples if n == "tgi_batch_current_size")
    last = {n: v for n, v in samples}
    reserve = reserved_peak(reqs, num_blocks, block_size, int(info["max_batch_size"]))
    result = {
        "num_blocks": num_blocks, "block_size": block_size, "pool_tokens": num_blocks * block_size,
        "scheduler": info.get("scheduler"), "safety_margin": info.get("safety_margin"),
        "on_demand_peak_running": peak, "reserved_peak_running": reserve, "ratio": peak / reserve,
        "offloads": last.get("cb_offloads_total"), "soft_resets": last.get("cb_preemptions_total"),
        "errors": sum(r["error"] is not None for r in records), "wall_s": wall,
        "output_tok_s": sum(r["tokens"] for r in records) / wall,
    }
    typer.echo(json.dumps(result, indent=1))
    if out:
        out.write_text(json.dumps(result, indent=1))


@app.command()
def prefix(prefix_tokens: int = 1024, runs: int = 3, dtype: str = DEFAULTS.dtype, launcher_args: str = ""):
    import random

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = launch_server(port, dtype, ["--max-input-tokens", str(prefix_tokens + 64),
                                       "--max-total-tokens", str(prefix_tokens + 128), *launcher_args.split()], url)
    rng = random.Random(0)

    def ttft(ids) -> float:
        t = time.perf_counter()
        r = httpx.post(f"{url}/generate", json={"inputs": ids, "parameters": {"max_new_tokens": 1}}, timeout=600)
        r.raise_for_status()
        return time.perf_counter() - t

    try:
        ttft([rng.randrange(100, 49000) for _ in range(prefix_tokens + 8)])  # warm-up
        cold, cached = [], []
        for _ in range(runs):
            shared = [rng.randrange(100, 49000) for _ in range(prefix_tokens)]
            cold.append(ttft(shared + [rng.randrange(100, 49000) for _ in range(8)]))
            cached.append(ttft(shared + [rng.randrange(100, 49000) for _ in range(8)]))
    finally:
        stop_server(proc)
    result = {"prefix_tokens": prefix_tokens, "cold_ttft_s": statistics.median(cold),
              "cached_ttft_s": statistics.median(cached),
              "ratio": statistics.median(cached) / statistics.median(cold), "cold": cold, "cached": cached}
    typer.echo(json.dumps(result, indent=1))


@app.command()
def offload(model_id: str = DEFAULTS.model_id, dtype: str = DEFAULTS.dtype, blocks: str = "16,64",
            block_size: int = DEFAULTS.block_size, runs: int = 5):
    import torch

    from launcher.model_files import resolve_model
    from shard.model import load
    from shard.runner import Runner
    from shard.sampling import Params
    from shard.step import Entry
    from shard.swap import SwapPool

    device = torch.device("cpu")
    loaded = load(str(resolve_model(model_id)), dtype, device, 0, 1)
    runner = Runner(loaded, device, block_size, 0, 1)
    sizes = [int(b) for b in blocks.split(",")]
    runner.allocate(max(sizes) + 1)
    pool = runner.cache.full
    swap = SwapPool(pool, max(sizes))
    rows = []
    for n in sizes:
        tokens = n * block_size
        entry = Entry(1, [100 + i % 1000 for i in range(tokens)], list(range(n)), sample=True, params=Params())
        recompute, copy = [], []
        for _ in range(runs):
            runner.clear()
            t = time.perf_counter()
            runner.step([entry])
            recompute.append(time.perf_counter() - t)
            t = time.perf_counter()
            swap.offload(pool, list(range(n)), list(range(n)))
            swap.restore(pool, list(range(n)), list(range(n)))
            copy.append(time.perf_counter() - t)
        rows.append({"blocks": n, "tokens": tokens, "recompute_s": statistics.median(recompute),
                     "offload_and_restore_s": statistics.median(copy),
                     "ratio": statistics.median(copy) / statistics.median(recompute)})
        typer.echo(json.dumps(rows[-1]))


if __name__ == "__main__":
    app()
