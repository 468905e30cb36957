"""The load generator: sends a workload to a running server at the given arrival offsets, under an optional
concurrency cap, and timestamps every streamed token on arrival. Two protocols: TGI's /generate_stream (cb) and
OpenAI's streamed /v1/completions (cb, llama.cpp's llama-server, vLLM), so one client measures them all."""
from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Optional

import httpx

from bench.stats import new_record
from bench.workloads import Req


class TGI:
    """TGI's /generate_stream: one event per token, the last one with `details`."""
    path = "/generate_stream"
    chunk_is_token = True  # a stream that lost an event would count short of max_new_tokens

    def __init__(self, model: Optional[str] = None):
        self.model = model

    def body(self, req: Req) -> dict:
        return {"inputs": req.inputs,
                "parameters": {"max_new_tokens": req.max_new_tokens, "ignore_eos": True, "details": True}}

    def read(self, ev: dict, rec: dict) -> bool:
        """Records what an event says; True when it carries a token."""
        if ev.get("error") is not None:
            rec["error"] = f"{ev.get('error_type') or 'stream'}: {ev['error']}"
        elif ev.get("generated_text") is not None:
            details = ev.get("details") or {}
            rec["finish_reason"] = details.get("finish_reason")
            rec["generated_tokens"] = details.get("generated_tokens")
        return ev.get("token") is not None


class OpenAI(TGI):
    """OpenAI's streamed /v1/completions (cb, llama.cpp's llama-server, vLLM): a chunk per token, then one with the
    finish reason; the token count comes from `usage`. Prompts go as token ids where the workload has them. A chunk
    is not always one token: cb sends none for a token whose text is not yet whole (a character split over byte
    tokens), vLLM one per step (several tokens with speculation); ITL stays a gap between chunks, as vLLM's bench
    measures it."""
    path = "/v1/completions"
    chunk_is_token = False

    def body(self, req: Req) -> dict:
        out = {"prompt": req.inputs, "max_tokens": req.max_new_tokens, "ignore_eos": True, "temperature": 0,
               "stream": True, "stream_options": {"include_usage": True}}
        if req.response_format is not None:
            out["response_format"] = req.response_format
        return {"model": self.model, **out} if self.model else out

    def read(self, ev: dict, rec: dict) -> bool:
        if isinstance(ev.get("error"), dict):
            rec["error"] = f"{ev['error'].get('code') or ev['error'].get('type')}: {ev['error'].get('message')}"
        if ev.get("usage"):
            rec["generated_tokens"] = ev["usage"].get("completion_tokens")
        choice = (ev.get("choices") or [None])[0]
        if choice is None:
            return False
        if choice.get("finish_reason"):
            rec["finish_reason"] = choice["finish_reason"]
            return False
        return True


BACKENDS = {"tgi": TGI, "openai": OpenAI}


def backend_for(url: str, name: str) -> TGI:
    """The protocol by name; OpenAI's names the model the server lists (vLLM refuses any other)."""
    return BACKENDS[name](served_model(url) if name == "openai" else None)


def cli_options(default_label: str = "cb"):
    """(url, backend, label): the options the latency tools share, as typer defaults."""
    import typer
    return (typer.Option("http://127.0.0.1:8080", help="The server."),
            typer.Option("tgi", help="tgi (/generate_stream) or openai (/v1/completions)."),
            typer.Option(default_label, help="What the server is called in the report."))


def _error(resp, raw: bytes) -> str:
    try:
        err = json.loads(raw)
    except ValueError:
        return f"HTTP {resp.status_code}: {raw[:200]!r}"
    if isinstance(err.get("error"), dict):
        return f"{err['error'].get('code') or resp.status_code}: {err['error'].get('message')}"
    return f"{err.get('error_type') or resp.status_code}: {err.get('error')}"


async def one_request(client: httpx.AsyncClient, url: str, req: Req, sem: asyncio.Semaphore,
                      start_at: float, t_run: float, backend: TGI) -> dict:
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
            async with client.stream("POST", url + backend.path, json=backend.body(req)) as resp:
                if resp.status_code != 200:
                    rec["error"] = _error(resp, await resp.aread())
                else:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                            continue
                        now = time.perf_counter()
                        if backend.read(json.loads(line[5:]), rec):
                            rec["tokens"] += 1
                            if last is None:
                                rec["ttft"] = now - t0
                            else:
                                rec["itl"].append(now - last)
                            last = now
                        if rec["error"] is not None:
                            break
        except (httpx.HTTPError, ValueError) as e:
            rec["error"] = f"{type(e).__name__}: {e}"
        rec["e2e"] = time.perf_counter() - t0
        if not backend.chunk_is_token and rec.get("generated_tokens") is not None:
            rec["chunks"], rec["tokens"] = rec["tokens"], rec["generated_tokens"]
    return rec


async def replay(url: str, reqs: list[Req], arrivals: Optional[list[float]] = None,
                 max_concurrency: Optional[int] = None, progress: bool = True, desc: str = "cb",
                 backend: Optional[TGI] = None) -> tuple[list[dict], float]:
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
            rec = await one_request(client, url, req, sem, t_run + offset, t_run, backend or TGI())
            if bar is not None:
                bar.update(1)
            return rec

        recs = await asyncio.gather(*(tracked(r, a) for r, a in zip(reqs, arrivals)))
        wall = time.perf_counter() - t_run
    if bar is not None:
        bar.close()
    return list(recs), wall


def run(url: str, reqs: list[Req], arrivals=None, max_concurrency=None, progress=True, desc="cb", backend=None):
    return asyncio.run(replay(url, reqs, arrivals, max_concurrency, progress, desc, backend))


def server_info(url: str) -> dict:
    """cb's /info ({} from servers that have none)."""
    try:
        r = httpx.get(f"{url}/info", timeout=10)
        return r.json() if r.status_code == 200 and "max_batch_size" in r.text else {}
    except (httpx.HTTPError, ValueError):
        return {}


def served_model(url: str) -> Optional[str]:
    """The first model an OpenAI-compatible server lists (vLLM refuses any other name)."""
    try:
        return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return None
