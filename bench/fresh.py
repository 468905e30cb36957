"""A fresh server's first burst, measured as a user meets it: start a server (cb, vLLM, llama.cpp: any command),
wait until it answers, send it `--warmup` single requests, then W64 (the headline: its first burst), then W64 again
on the same server (labelled: every prompt is then a prefix-cache hit), then stop it. One client (bench/client.py,
streamed OpenAI /v1/completions with token-id prompts and ignore_eos) for every server.

    python -m bench.fresh --label cb --url http://127.0.0.1:8100 -- cb-launcher --port 8100 --max-batch-total-tokens 32768
    python -m bench.fresh --label vllm --url http://127.0.0.1:8300 -- bash vllm-cpu.sh 8300

Numbers for docs/benchmarks.md, never for tests: run each server alone on the machine, in one window.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional

import httpx
import typer

from bench import client, stats
from bench.workloads import DEFAULT_WORKLOAD, Req, load_w64, random_workload

app = typer.Typer(add_completion=False, rich_markup_mode=None, help=__doc__)
WARMUP = Req(-1, 32, 16, prompt_ids=[100 + k for k in range(32)])  # one short request


def wait_until_up(url: str, path: str, proc: subprocess.Popen, timeout: float) -> float:
    """Seconds until GET url+path answers 200; raises if the server exits or never answers."""
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it answered")
        try:
            if httpx.get(f"{url}{path}", timeout=2.0).status_code == 200:
                return time.monotonic() - began
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"no answer from {url}{path} after {timeout:.0f} s")


def wait_until_compiled(url: str, timeout: float) -> float:
    """Seconds until cb's /info no longer says pending or compiling."""
    began = time.monotonic()
    while httpx.get(f"{url}/info", timeout=10).json().get("compile_state") in ("pending", "compiling"):
        if time.monotonic() - began > timeout:
            raise RuntimeError(f"still compiling after {timeout:.0f} s")
        time.sleep(0.5)
    return time.monotonic() - began


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's whole process group, SIGKILL after 60 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def cb_counters(url: str) -> dict[str, float]:
    """cb's step counters (nothing from other servers): steps run and prompt chunks cut short."""
    from prometheus_client.parser import text_string_to_metric_families
    wanted = {"cb_prefill_chunks_total": "chunks", "cb_forward_steps_total": "steps"}
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in wanted:
                    out[wanted[sample.name]] = out.get(wanted[sample.name], 0) + sample.value
        return out
    except (httpx.HTTPError, ValueError):
        return {}


def burst(url: str, reqs: list[Req], backend, label: str) -> dict:
    before = cb_counters(url)
    recs, wall = client.run(url, reqs, progress=False, desc=label, backend=backend)
    summary = stats.summarize(recs, wall)
    summary.update({k: v - before.get(k, 0) for k, v in cb_counters(url).items()})
    typer.echo(stats.report(summary, title=label) + "".join(f"\n  {k}: {summary[k]:.0f}" for k in ("steps", "chunks")
                                                           if k in summary))
    return summary


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def main(ctx: typer.Context, url: str = typer.Option(..., help="where the server will answer"),
         label: str = typer.Option(..., help="what the server is called in the report"),
         ready_path: str = typer.Option("/health", help="GET path that answers 200 once it serves"),
         warmup: int = typer.Option(1, help="single requests before the burst (0: the burst comes first)"),
         repeats: int = typer.Option(2, help="W64 bursts on the same server (the first is the headline)"),
         workload: Path = typer.Option(DEFAULT_WORKLOAD, help="the W64 JSON file"),
         compiled: bool = typer.Option(False, help="cb: before sending anything, wait until /info says the step "
                                       "sizes' background compile is over (by default the burst may meet it)"),
         single: int = typer.Option(3, help="after the bursts, this many one-at-a-time streams (random 32-token "
                                    "prompts, 256 tokens each, so no cache helps): the one-stream time per token"),
         log: Optional[Path] = typer.Option(None, help="the server's output goes here"),
         json_out: Optional[Path] = typer.Option(None, "--json", help="write the results here"),
         start_timeout: float = typer.Option(900.0, help="seconds the server may take to answer")):
    """Runs the server command given after `--`, measures it, stops it."""
    command = ctx.args
    if not command:
        raise typer.BadParameter("give the server's command after --")
    out = open(log, "w") if log else subprocess.DEVNULL
    began = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        ready = wait_until_up(url, ready_path, proc, start_timeout)
        typer.echo(f"{label}: answers after {ready:.1f} s")
        if compiled:
            ready += wait_until_compiled(url, start_timeout)
            typer.echo(f"{label}: compiled after {ready:.1f} s")
        backend = client.OpenAI(client.served_model(url))
        for _ in range(warmup):
            client.run(url, [WARMUP], progress=False, desc=label, backend=backend)
        reqs = load_w64(workload)
        runs = [burst(url, reqs, backend, f"{label}: W64 burst {i + 1}" + (" (prefix-cache hits)" if i else ""))
                for i in range(repeats)]
        one = None
        if single:
            recs, wall = client.run(url, random_workload(single, 32, 256, seed=7), max_concurrency=1,
                                    progress=False, desc=label, backend=backend)
            one = stats.summarize(recs, wall)
            typer.echo(f"{label}: one stream: {one['tpot_mean_ms']:.2f} ms/token (TPOT mean of {single})")
    finally:
        stop(proc)
    result = {"label": label, "command": command, "began": began, "ready_seconds": ready, "warmup": warmup,
              "waited_for_compile": compiled, "bursts": runs, "single_stream": one}
    if json_out:
        json_out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    app()
