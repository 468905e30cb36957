"""Throughput and inter-token latency against concurrency (`python -m bench.concurrency`).

`measure`: at each concurrency c (1, 2, 4, ... 64), 2c requests (at least 8) of the random dataset (128-token
prompts as ids, 64 forced new tokens) go to one server through cb-bench's client, at most c in flight; output
tok/s and ITL p50/p99 per level go to a JSON. `plot`: several such JSONs (cb, llama.cpp, vLLM) in one PNG.
Numbers for the README, never for tests.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from bench import client
from bench.stats import summarize
from bench.workloads import random_workload

app = typer.Typer(add_completion=False, rich_markup_mode=None, help=__doc__)


URL, BACKEND, LABEL = client.cli_options()


@app.command()
def measure(
    url: str = URL,
    backend: str = BACKEND,
    label: str = LABEL,
    levels: str = typer.Option("1,2,4,8,16,32,64", help="Concurrencies, comma-separated."),
    input_len: int = typer.Option(128, help="Prompt tokens."),
    output_len: int = typer.Option(64, help="Forced new tokens."),
    seed: int = typer.Option(0, help="Seed of the random token ids."),
    json_out: Path = typer.Option(..., "--json", help="Where the levels' results go."),
):
    url = url.rstrip("/")
    protocol = client.backend_for(url, backend)
    points, stopped = [], None
    for c in (int(x) for x in levels.split(",")):
        reqs = random_workload(max(8, 2 * c), input_len, output_len, seed=seed + c)
        recs, wall = client.run(url, reqs, max_concurrency=c, progress=False, backend=protocol)
        s = summarize(recs, wall)
        if s["errors"]:  # the levels measured so far are kept, and the reason said
            stopped = f"stopped at concurrency {c}: {s['errors_by_type']}"
            typer.echo(f"{label} {stopped}", err=True)
            break
        points.append({"concurrency": c, "output_tok_s": s["output_tok_s"], "itl_p50_ms": s["itl_p50_ms"],
                       "itl_p99_ms": s["itl_p99_ms"], "ttft_p50_ms": s["ttft_p50_ms"]})
        typer.echo(f"{label} c={c}: {s['output_tok_s']:.1f} tok/s, ITL p50 {s['itl_p50_ms']:.0f} ms, "
                   f"p99 {s['itl_p99_ms']:.0f} ms")
    json_out.write_text(json.dumps({"label": label, "url": url, "backend": backend, "input_len": input_len,
                                    "output_len": output_len, "points": points, "stopped": stopped}, indent=2))
    if stopped:
        raise typer.Exit(1)


@app.command()
def plot(results: list[Path], out: Path = typer.Option(..., help="The PNG."),
         title: Optional[str] = typer.Option(None)):
    from bench.plots import rate_sweep

    series = {}
    for path in results:
        data = json.loads(path.read_text())
        series[data["label"]] = [(p["concurrency"], p) for p in data["points"]]
    rate_sweep(series, out, title or "throughput and ITL against concurrency", latency_key="itl_p99_ms",
               latency_label="ITL p99 (ms)", x_label="concurrent requests")
    typer.echo(f"plot: {out}")


if __name__ == "__main__":
    app()
