"""The load generator: sends a workload to a running server's /generate_stream at the given arrival offsets,
under an optional concurrency cap, and timestamps every streamed token on arrival."""
from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Optional

import httpx

from bench.stats import new_record
from bench.workloads import Req


def body(req: Req) -> dict:
    return {"inputs": req.inputs,
            "parameters": {"max_new_tokens": req.max_new_tokens, "ignore_eos": True, "details": True}}


async def one_request(client: httpx.AsyncClient, url: str, req: Req, sem: asyncio.Semaphore,
                      start_at: float, t_run: float) -> dict:
    """Waits for its arrival time and a concurrency slot, then streams; times are from its own send."""
    rec = new_record(req)
    delay = start_at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    async with sem:
        t0 = time.perf_counter()
        rec["start"] = t0 - t_run
        last = None
        try:
            async with client.stream("POST", f"{url}/generate_stream", json=body(req)) as resp:
                if resp.status_code != 200:
                    raw = await resp.aread()
                    try:
                        err = json.loads(raw)
                        rec["error"] = f"{err.get('error_type') or resp.status_code}: {err.get('error')}"
                    except ValueError:
                        rec["error"] = f"HTTP {resp.status_code}: {raw[:200]!r}"
                else:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        now = time.perf_counter()
                        ev = json.loads(line[5:])
                        if ev.get("error") is not None:
                            rec["error"] = f"{ev.get('error_type') or 'stream'}: {ev['error']}"
                            break
                        if ev.get("token") is not None:
                            rec["tokens"] += 1
                            if last is None:
                                rec["ttft"] = now - t0
                            else:
                                rec["itl"].append(now - last)
                            last = now
                        if ev.get("generated_text") is not None:
                            details = ev.get("details") or {}
                            rec["finish_reason"] = details.get("finish_reason")
                            rec["generated_tokens"] = details.get("generated_tokens")
        except (httpx.HTTPError, ValueError) as e:
            rec["error"] = f"{type(e).__name__}: {e}"
        rec["e2e"] = time.perf_counter() - t0
    return rec


async def replay(url: str, reqs: list[Req], arrivals: Optional[list[float]] = None,
                 max_concurrency: Optional[int] = None, progress: bool = True,
                 desc: str = "cb") -> tuple[list[dict], float]:
    """Sends every request at its offset; wall time spans the first send to the last answer."""
    arrivals = arrivals or [0.0] * len(reqs)
    n = max_concurrency or len(reqs)
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    timeout = httpx.Timeout(3600.0, connect=60.0)
    sem = asyncio.Semaphore(n)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(reqs), desc=desc, unit="req", file=sys.stderr, leave=False)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        t_run = time.perf_counter()

        async def tracked(req: Req, offset: float) -> dict:
            rec = await one_request(client, url, req, sem, t_run + offset, t_run)
            if bar is not None:
                bar.update(1)
            return rec

        recs = await asyncio.gather(*(tracked(r, a) for r, a in zip(reqs, arrivals)))
        wall = time.perf_counter() - t_run
    if bar is not None:
        bar.close()
    return list(recs), wall


def run(url: str, reqs: list[Req], arrivals=None, max_concurrency=None, progress=True, desc="cb"):
    return asyncio.run(replay(url, reqs, arrivals, max_concurrency, progress, desc))


def server_info(url: str) -> dict:
    try:
        return httpx.get(f"{url}/info", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return {}
