"""What constrained decoding costs the requests beside it: W64 plain, then W64 with every fourth request held
to a JSON schema (`response_format` json_schema), alternated on one fresh server with prefix caching off (so no
burst is a cache hit), through the same streamed /v1/completions client as every benchmark.

    python -m bench.structured --url http://127.0.0.1:8100 -- \\
        cb-launcher --port 8100 --max-batch-total-tokens 32768 --no-prefix-caching

The schema (an array of at least 100 records, each an integer, an enum and a bounded string) cannot be complete
within W64's output lengths, so each constrained request still produces its forced token count and the two
bursts' throughputs compare the same work; its matcher computes a mask every step. Numbers for
docs/benchmarks.md, never for tests.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Optional

import httpx
import typer

from bench import client
from bench.fresh import WARMUP, burst, stop, wait_until_compiled, wait_until_up
from bench.workloads import DEFAULT_WORKLOAD, load_w64

app = typer.Typer(add_completion=False, rich_markup_mode=None, help=__doc__)
RECORDS = {"type": "array", "minItems": 100, "items": {
    "type": "object", "properties": {"id": {"type": "integer"}, "tag": {"enum": ["red", "green", "blue"]},
                                     "note": {"type": "string", "maxLength": 40}},
    "required": ["id", "tag", "note"], "additionalProperties": False}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "records", "schema": RECORDS}}


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def main(ctx: typer.Context, url: str = typer.Option(..., help="where the server will answer"),
         every: int = typer.Option(4, help="every this many requests is constrained"),
         rounds: int = typer.Option(2, help="plain/constrained pairs of bursts"),
         workload: Path = typer.Option(DEFAULT_WORKLOAD, help="the W64 JSON file"),
         log: Optional[Path] = typer.Option(None, help="the server's output goes here"),
         json_out: Optional[Path] = typer.Option(None, "--json", help="write the results here")):
    """Runs the server command given after `--`, measures it, stops it."""
    out = open(log, "w") if log else subprocess.DEVNULL
    proc = subprocess.Popen(ctx.args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    began = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    try:
        wait_until_up(url, "/health", proc, 900)
        wait_until_compiled(url, 900)
        if httpx.get(f"{url}/info", timeout=10).json().get("prefix_caching"):
            raise typer.BadParameter("start the server with --no-prefix-caching: a repeated burst would hit the cache")
        backend = client.OpenAI(client.served_model(url))
        client.run(url, [WARMUP], progress=False, desc="warmup", backend=backend)
        plain = load_w64(workload)
        mixed = [dataclasses.replace(r, response_format=FORMAT) if i % every == 0 else r for i, r in enumerate(plain)]
        runs = {"plain": [], "constrained": []}
        for _ in range(rounds):
            runs["plain"].append(burst(url, plain, backend, "W64 plain"))
            runs["constrained"].append(burst(url, mixed, backend, f"W64, 1 in {every} json_schema"))
    finally:
        stop(proc)
    tok_s = {k: [r["output_tok_s"] for r in v] for k, v in runs.items()}
    ratio = statistics.mean(tok_s["constrained"]) / statistics.mean(tok_s["plain"])
    typer.echo(f"output tok/s plain {tok_s['plain']}, constrained {tok_s['constrained']}: ratio {ratio:.3f}")
    if json_out:
        json_out.write_text(json.dumps({"began": began, "command": ctx.args, "every": every, "runs": runs,
                                        "ratio": ratio}, indent=1))


if __name__ == "__main__":
    app()
