"""Replicas behind a balancer, measured: N cb replicas, SGLang's Rust balancer (PyPI `sglang-router`) in front with
each routing policy in turn, and a shared-prefix workload through it (workloads.shared_prefix_workload): per
policy, the replicas' prefix-cache hit rate (from their /metrics), how the requests spread, TTFT and throughput.

    python -m bench.balancer --replicas 2 --policies round_robin,cache_aware -- cb-launcher --max-batch-total-tokens 16384

The command after `--` starts one replica (`--port P` is appended, and `--trace-file` with --traces, for cb-sim's
replica mode to calibrate on). Each policy gets passages of its own (a seed each), so what one policy's run cached
does not help the next. Numbers for docs/benchmarks.md; tests/e2e/test_balancer.py runs the same on loopback.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx
import typer

from bench import client, stats
from bench.fresh import stop, wait_until_up
from bench.server import free_port
from bench.workloads import Req, shared_prefix_workload

app = typer.Typer(add_completion=False, rich_markup_mode=None, help=__doc__)
POLICIES = ("round_robin", "cache_aware", "power_of_two", "random")
COUNTERS = {"cb_prefix_cache_hit_tokens_total": "hit_tokens", "tgi_request_input_length_sum": "prompt_tokens",
            "tgi_request_success_total": "served"}


def per_replica(replicas: int) -> int:
    return max(1, len(os.sched_getaffinity(0)) // replicas)


def cores(i: int, replicas: int, pin: bool) -> list[str]:
    """`taskset -c` for replica i's share of this process's cores (nothing when not pinning, or without taskset)."""
    if not pin or shutil.which("taskset") is None:
        return []
    mine, n = sorted(os.sched_getaffinity(0)), per_replica(replicas)
    return ["taskset", "-c", ",".join(str(mine[(i * n + k) % len(mine)]) for k in range(n))]


def start_balancer(policy: str, workers: list[str], port: int, log=subprocess.DEVNULL) -> subprocess.Popen:
    """sglang-router on 127.0.0.1:port in front of `workers`, once it answers /v1/models."""
    if importlib.util.find_spec("sglang_router") is None:  # run as a module of this interpreter's packages
        raise RuntimeError("sglang-router is not installed (pip install 'sglang-router>=0.3.2,<0.4')")
    proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                             str(port), "--policy", policy, "--prometheus-port", str(free_port()),
                             "--log-level", "warn", "--worker-urls", *workers],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until_up(f"http://127.0.0.1:{port}", "/v1/models", proc, 120.0)
    except Exception:
        stop(proc)
        raise
    return proc


def counters(url: str) -> dict[str, float]:
    """A cb replica's prefix-cache hits, prompt tokens and requests served so far."""
    from prometheus_client.parser import text_string_to_metric_families
    out = dict.fromkeys(COUNTERS.values(), 0.0)
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name in COUNTERS:
                out[COUNTERS[sample.name]] += sample.value
    return out


def measure(url: str, replicas: list[str], reqs: list[Req], concurrency: int) -> dict:
    """Sends `reqs` through the balancer at `url`; the summary (stats.summarize) with the replicas' hit rate (hit
    tokens over prompt tokens, all replicas together) and each replica's share of the requests."""
    before = [counters(r) for r in replicas]
    recs, wall = client.run(url, reqs, max_concurrency=concurrency, progress=False,
                            backend=client.OpenAI(client.served_model(url)))
    after = [counters(r) for r in replicas]
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    summary = stats.summarize(recs, wall)
    prompt = sum(d["prompt_tokens"] for d in delta)
    summary.update(hit_rate=sum(d["hit_tokens"] for d in delta) / prompt if prompt else 0.0,
                   prompt_tokens=prompt, served_per_replica=[int(d["served"]) for d in delta])
    return summary


def report(policy: str, s: dict) -> str:
    return (f"{policy:>12}: {s['completed']}/{s['requests']} answered, prefix hit rate {s['hit_rate']:.1%}, "
            f"spread {s['served_per_replica']}, {s['output_tok_s']:.1f} tok/s out, "
            f"TTFT mean {s['ttft_mean_ms']:.0f} ms, p99 {s['ttft_p99_ms']:.0f} ms, wall {s['wall_s']:.1f} s")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def main(ctx: typer.Context, replicas: int = typer.Option(2, min=1),
         policies: str = typer.Option("round_robin,cache_aware", help=f"comma-separated: {', '.join(POLICIES)}"),
         docs: int = typer.Option(5, help="passages (odd: round robin then moves each between 2 replicas)"),
         questions: int = typer.Option(8, help="questions per passage"),
         doc_words: int = typer.Option(300, help="words per passage"),
         max_new_tokens: int = typer.Option(32),
         concurrency: int = typer.Option(8, help="requests in flight at once"),
         pin: bool = typer.Option(True, help="give each replica its own cores (taskset, OMP_NUM_THREADS): replicas "
                                 "that each spread over every core spin against one another"),
         traces: Optional[Path] = typer.Option(None, help="folder: each replica writes its router trace here"),
         json_out: Optional[Path] = typer.Option(None, "--json"),
         log: Optional[Path] = typer.Option(None, help="the replicas' and the balancer's output goes here")):
    """Starts the replicas (the command after --), then per policy a balancer and the workload through it."""
    command = ctx.args
    if not command:
        raise typer.BadParameter("give one replica's command after --")
    out = open(log, "w") if log else subprocess.DEVNULL
    ports = [free_port() for _ in range(replicas)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    if traces:
        traces.mkdir(parents=True, exist_ok=True)
    procs = [subprocess.Popen([*cores(i, replicas, pin), *command, "--port", str(p),
                               *(["--trace-file", str(traces / f"replica-{i}.jsonl")] if traces else [])],
                              stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                              env={**os.environ, **({"OMP_NUM_THREADS": str(per_replica(replicas))} if pin else {})})
             for i, p in enumerate(ports)]
    results = {"replicas": replicas, "command": command, "pinned": pin, "docs": docs, "questions": questions,
               "doc_words": doc_words, "max_new_tokens": max_new_tokens, "concurrency": concurrency,
               "began": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "policies": {}}
    try:
        for url, proc in zip(urls, procs):
            wait_until_up(url, "/health", proc, 900.0)
        results["server_info"], results["traces"] = client.server_info(urls[0]), str(traces) if traces else None
        for seed, policy in enumerate(policies.split(",")):
            port = free_port()
            balancer = start_balancer(policy, urls, port, out)
            try:
                reqs = shared_prefix_workload(docs, questions, doc_words, max_new_tokens, seed=seed)
                summary = measure(f"http://127.0.0.1:{port}", urls, reqs, concurrency)
            finally:
                stop(balancer)
            results["policies"][policy] = summary
            typer.echo(report(policy, summary))
    finally:
        for proc in procs:
            stop(proc)
    if json_out:
        json_out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    app()
