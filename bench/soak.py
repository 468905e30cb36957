"""The soak (`make soak`, `python -m bench.soak`): a default server (`--dtype auto`) under a long mixed load, to catch what a
short test cannot: requests lost or failed after hours of churn, KV blocks that never come back, memory that
keeps growing.

It launches its own server, then sends rounds of requests at a fixed concurrency: short and long prompts (some
sharing a prefix), TGI's and OpenAI's routes, streamed and not, greedy and sampled, ~10% hung up mid-stream by
closing the connection. After each round it waits for the server to be idle and reads the RSS of every process
of the server's tree (VmRSS, through psutil). It reports errors and lost requests (both must be 0), the RSS
table, and whether the KV cache is idle at the end (every block free, nothing running, waiting or offloaded);
it exits 1 when any of these fails.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import httpx
import psutil
import typer

from bench.client import TGI, OpenAI
from bench.server import free_port, launch_server, stop_server
from router.settings import Settings

TEXT = (Path(__file__).resolve().parent / "data" / "quality.txt").read_text().split()
SHARED_PREFIX = " ".join(TEXT[:120])  # prompts that start with it exercise the prefix cache
REQUEST_TIMEOUT = 600.0  # s: a request with no answer by then is lost

app = typer.Typer(add_completion=False, rich_markup_mode=None)


@dataclass
class Shot:
    """One request of the soak: where it goes, its body, and after how many tokens the client hangs up."""
    path: str
    body: dict
    stream: bool
    hang_up_after: Optional[int] = None


def prompt(rng: random.Random) -> str:
    """Mostly short prompts, a quarter long ones (200-450 words, up to ~800 tokens); 30% share a prefix."""
    words = rng.randint(200, 450) if rng.random() < 0.25 else rng.randint(5, 40)
    text = " ".join(rng.choices(TEXT, k=words))
    return f"{SHARED_PREFIX} {text}" if rng.random() < 0.3 else text


def shot(rng: random.Random, i: int) -> Shot:
    """Route, streaming, sampling and length drawn at random; a fifth of the streams are hung up on after 1-3
    tokens, with room left (24-48 tokens, EOS ignored) so the hang-up lands mid-stream."""
    stream = rng.random() < 0.5
    hang_up = stream and rng.random() < 0.2
    new_tokens = rng.randint(24, 48) if hang_up else rng.randint(1, 16)
    sampled = rng.random() < 0.5
    route = rng.choice(["tgi", "completions", "chat"])
    text = prompt(rng)
    if route == "tgi":
        parameters = {"max_new_tokens": new_tokens, "ignore_eos": hang_up, "details": True}
        if sampled:
            parameters.update(do_sample=True, temperature=0.8, top_p=0.9, top_k=50, seed=i)
        path, body = ("/generate_stream" if stream else "/generate"), {"inputs": text, "parameters": parameters}
    else:
        body = {"max_tokens": new_tokens, "ignore_eos": hang_up, "stream": stream,
                "temperature": 0.8 if sampled else 0, "top_p": 0.9 if sampled else 1.0, "seed": i}
        if route == "chat":
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], **body}
        else:
            path, body = "/v1/completions", {"prompt": text, **body}
    return Shot(path, body, stream, rng.randint(1, 3) if hang_up else None)


async def send(client: httpx.AsyncClient, url: str, s: Shot) -> str:
    """The request's outcome: answered, cancelled (we hung up), error (the server said so) or lost (no answer)."""
    try:
        async with client.stream("POST", url + s.path, json=s.body, timeout=REQUEST_TIMEOUT) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return f"error: HTTP {resp.status_code} {resp.text[:200]}"
            if not s.stream:
                answer = json.loads(await resp.aread())
                return "answered" if "generated_text" in answer or answer.get("choices") else f"error: {answer}"
            return await read_stream(resp, s)
    except (httpx.TimeoutException, httpx.RemoteProtocolError, httpx.ReadError) as e:
        return f"lost: {type(e).__name__}: {e}"
    except (httpx.HTTPError, ValueError) as e:
        return f"error: {type(e).__name__}: {e}"


async def read_stream(resp: httpx.Response, s: Shot) -> str:
    """Reads SSE events as cb-bench does (bench/client.py); leaving early closes the connection: a hang-up."""
    tgi = s.path == "/generate_stream"
    backend, rec, tokens = (TGI() if tgi else OpenAI()), {"error": None}, 0
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        if line[5:].strip() == "[DONE]":
            return "answered"
        event = json.loads(line[5:])
        tokens += backend.read(event, rec)
        if rec["error"] is not None:
            return f"error: {rec['error']}"
        if tgi and event.get("generated_text") is not None:
            return "answered"
        if s.hang_up_after is not None and tokens >= s.hang_up_after:
            return "cancelled"
    return "lost: the stream ended without its last event"


async def run_round(url: str, shots: list[Shot], concurrency: int) -> tuple[Counter, list[str], float]:
    """All shots, `concurrency` at a time: outcome counts, the distinct problems, wall seconds."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    slots = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(limits=limits) as client:
        async def one(s: Shot) -> str:
            async with slots:
                return await send(client, url, s)

        start = time.monotonic()
        outcomes = await asyncio.gather(*(one(s) for s in shots))
    counts = Counter(o.split(":")[0] for o in outcomes)
    return counts, sorted({o for o in outcomes if o.startswith(("error", "lost"))}), time.monotonic() - start


def server_tree(root: int) -> dict[str, int]:
    """The launcher and its descendants by role (launcher, router, shard N): {name: pid}."""
    tree = {"launcher": root}
    for proc in psutil.Process(root).children(recursive=True):
        try:
            args = proc.cmdline()
        except psutil.ZombieProcess:
            args = []  # exited, not yet reaped: no command line
        except psutil.Error:
            continue
        tree[role(args, proc.pid)] = proc.pid
    return tree


def role(args: list[str], pid: int) -> str:
    if "router" in args:
        return "router"
    if "shard" in args and "--rank" in args:
        return f"shard {args[args.index('--rank') + 1]}"
    return f"pid {pid}"


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if not s.labels}


IDLE = {"cb_kv_blocks_free": "cb_kv_blocks_total", "cb_swap_blocks_free": "cb_swap_blocks_total"}
EMPTY = ("tgi_batch_current_size", "tgi_queue_size", "cb_offloaded_requests")


def idle_problems(m: dict[str, float]) -> list[str]:
    """What keeps the server from idle: blocks not back in their pools, requests running, waiting or offloaded."""
    out = [f"{free} {m.get(free)} != {total} {m.get(total)}" for free, total in IDLE.items()
           if m.get(free) != m.get(total)]
    return out + [f"{name} {m[name]}" for name in EMPTY if m.get(name)]


def wait_idle(url: str, timeout: float = 60.0) -> list[str]:
    """Blocks are freed a step after their request ends: waits until idle, else returns what is not."""
    deadline = time.monotonic() + timeout
    while (problems := idle_problems(metrics(url))) and time.monotonic() < deadline:
        time.sleep(0.5)
    return problems


def report_rss(samples: list[dict[str, float]]) -> None:
    names = list(samples[0])
    head = ["process", "start"] + [f"after {i}" for i in range(1, len(samples))] + ["last round"]
    typer.echo("\nRSS, MB (VmRSS, once the server is idle)\n" + " | ".join(head))
    for name in names:
        row = [samples[i].get(name, 0.0) for i in range(len(samples))]
        last = row[-1] - row[-2] if len(row) > 1 else 0.0
        typer.echo(" | ".join([name, *(f"{v:,.0f}" for v in row), f"{last:+,.0f}"]))


@app.command()
def main(requests: int = typer.Option(1000, help="requests in all, spread over the rounds"),
         rounds: int = typer.Option(4, help="rounds; RSS is read after each, so growth per round shows"),
         concurrency: int = typer.Option(32, help="requests in flight at once"),
         port: Optional[int] = typer.Option(None, help="HTTP port of the launched server (default: a free one)"),
         seed: int = typer.Option(0),
         launcher_args: str = typer.Option("", help="extra cb-launcher arguments"),
         server_log: Optional[Path] = typer.Option(None, help="keep the server's log here (default: this output)"),
         json_path: Optional[Path] = typer.Option(None, "--json", help="write the results here")):
    """Soaks a launched default server; exit 1 on any error, lost request, or a server not idle at the end."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    rng = random.Random(seed)
    proc = launch_server(port, Settings().dtype, launcher_args.split(), url, server_log)
    try:
        result = soak(url, proc.pid, rng, requests, rounds, concurrency)
    finally:
        stop_server(proc)
    if json_path:
        json_path.write_text(json.dumps(result, indent=1))
    ok = not result["errors"] and not result["lost"] and not result["idle_problems"]
    typer.echo(f"\n{'PASS' if ok else 'FAIL'}: {result['sent']} sent, {result['answered']} answered, "
               f"{result['cancelled']} cancelled, {result['errors']} errors, {result['lost']} lost; "
               f"KV cache {'idle' if not result['idle_problems'] else 'NOT idle: ' + '; '.join(result['idle_problems'])}")
    raise typer.Exit(0 if ok else 1)


def rss_of_tree(launcher_pid: int) -> dict[str, float]:
    """Read afresh each time: a replaced shard is a new process."""
    return {name: rss_mb(pid) for name, pid in server_tree(launcher_pid).items()}


def soak(url: str, launcher_pid: int, rng: random.Random, requests: int, rounds: int, concurrency: int) -> dict:
    samples, totals, problems, per_round = [rss_of_tree(launcher_pid)], Counter(), [], []
    sizes = [requests // rounds + (i < requests % rounds) for i in range(rounds)]
    for r, size in enumerate(sizes, 1):
        shots = [shot(rng, sum(sizes[:r - 1]) + i) for i in range(size)]
        counts, found, wall = asyncio.run(run_round(url, shots, concurrency))
        not_idle = wait_idle(url)
        samples.append(rss_of_tree(launcher_pid))
        totals.update(counts)
        problems += found + not_idle
        per_round.append({"requests": size, "seconds": round(wall, 1), **counts})
        typer.echo(f"round {r}/{rounds}: {size} requests in {wall:.0f} s ({size / wall:.1f}/s): "
                   + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
                   + "".join(f"\n  {p}" for p in found + not_idle))
    report_rss(samples)
    final = wait_idle(url)
    sent = sum(sizes)
    return {"sent": sent, "answered": totals["answered"], "cancelled": totals["cancelled"],
            "errors": totals["error"], "lost": sent - totals["answered"] - totals["cancelled"] - totals["error"],
            "rounds": per_round, "rss_mb": samples, "problems": problems, "idle_problems": final,
            "metrics": metrics(url)}


if __name__ == "__main__":
    app()
