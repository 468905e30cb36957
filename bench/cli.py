"""cb-bench: load a running cb server (or one it launches) with a workload and report throughput and latency.

Workloads: W64 (bench/data/w64.json, replayed exactly: token ids, forced output lengths), `random` (vLLM's random
dataset) or a text file of prompts; every request ignores EOS, so every system does the same work. Arrivals: all
at once (`--request-rate inf`), Poisson or fixed at a rate, optionally capped by `--max-concurrency`; `--sweep`
runs several rates. `--baseline static|transformers-cb` replays the same workload and arrivals in-process through
HF `generate` in static padded batches or transformers' own continuous batching, and prints them side by side.
"""
from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from bench import baselines, client, stats
from bench.server import launch_server, stop_server
from bench.workloads import (DEFAULT_WORKLOAD, GROUNDED, Req, arrival_times, describe, grounded_workload, load_w64,
                             parse_rate, random_workload, text_workload)
from router.api.info import Info
from router.core.allocator import ceil_div
from router.settings import Settings

app = typer.Typer(add_completion=False, rich_markup_mode=None, help=__doc__)
DEFAULTS = Settings()
BENCH_TOTAL_TOKENS = 32768  # `make bench`'s --max-batch-total-tokens: the baselines' cache when no server says


def build_workload(name: str, path: Optional[Path], n: Optional[int], input_len: int, output_len: int,
                   range_ratio: float, seed: int, model_dir: Optional[str]) -> list[Req]:
    if name == "w64":
        reqs = load_w64(path or DEFAULT_WORKLOAD)[:n or None]
    elif name == "random":
        reqs = random_workload(n or 64, input_len, output_len, range_ratio, seed)
    elif name == "text":
        if path is None:
            raise typer.BadParameter("--dataset-name text needs --dataset-path (one prompt per line)")
        reqs = text_workload(path, output_len, n, local_tokenizer(model_dir))
    elif name == "grounded":
        reqs = grounded_workload(path or GROUNDED, n, local_tokenizer(model_dir))
    else:
        raise typer.BadParameter(f"unknown dataset {name!r}: w64, random, text or grounded")
    typer.echo(f"workload: {name} {path or ''} ({describe(reqs)})")
    return reqs


def local_tokenizer(model_dir: Optional[str]):
    """The model's tokenizer for prompt lengths (the server tokenizes anyway): None, with a note, without one."""
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(model_dir or resolved_model(DEFAULTS.model_id))
    except Exception as e:
        typer.echo(f"no local tokenizer ({e}); prompt lengths will show as 0", err=True)
        return None


def resolved_model(model_id: str) -> str:
    """The local directory of a model id as the launcher resolves it (baselines and the ceiling load it)."""
    from launcher.model_files import resolve_model
    return str(resolve_model(model_id))


def local_model(model_id: str) -> Optional[str]:
    """The server's model for the in-process runs, or None (said) when its name is not one this machine can
    load, e.g. a --served-model-name: then --model-dir is needed."""
    from launcher.model_files import ModelNotFoundError
    try:
        return resolved_model(model_id)
    except ModelNotFoundError:
        typer.echo(f"the server calls its model {model_id!r}, which names no local model: no baselines or ceiling "
                   "(give --model-dir)", err=True)
        return None


def _rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _outputs(json_out: Optional[Path], result_dir: Optional[Path]) -> tuple[Optional[Path], Optional[Path]]:
    """(JSON path, prefix for PNGs)."""
    if result_dir is not None:
        result_dir.mkdir(parents=True, exist_ok=True)
        return json_out or result_dir / "result.json", result_dir / "bench"
    if json_out is not None:
        return json_out, json_out.with_suffix("")
    return None, None


@app.command()
def main(
    url: Optional[str] = typer.Option(None, help="Server URL (default http://127.0.0.1:PORT)."),
    backend: str = typer.Option("tgi", help="tgi (/generate_stream) or openai (/v1/completions: llama.cpp, vLLM)."),
    label: str = typer.Option("cb", help="What the server is called in the report."),
    port: int = typer.Option(DEFAULTS.port, help="Port, used for --launch and the default URL."),
    dataset_name: str = typer.Option("w64", help="w64 (exact), random, text, or grounded (repeat or edit a passage "
                                     "in the prompt: where --speculate pays; bench/data/grounded.json)."),
    dataset_path: Optional[Path] = typer.Option(None, help="text: a file with one prompt per line."),
    workload: Path = typer.Option(DEFAULT_WORKLOAD, help="The W64 JSON file (--dataset-name w64)."),
    num_prompts: Optional[int] = typer.Option(None, help="Requests (random: 64; w64/text: the whole file)."),
    random_input_len: int = typer.Option(128, help="random: mean prompt length."),
    random_output_len: int = typer.Option(128, help="random: mean output length (forced)."),
    random_range_ratio: float = typer.Option(0.0, help="random: lengths uniform in len*(1±ratio)."),
    output_len: int = typer.Option(128, help="text: tokens to generate per prompt (forced)."),
    seed: int = typer.Option(0, help="Seed of the random dataset and of the arrival process."),
    request_rate: str = typer.Option("inf", help="Requests per second; inf sends all at once."),
    arrival: str = typer.Option("poisson", help="Arrival process at a finite rate: poisson or fixed."),
    burstiness: float = typer.Option(1.0, help="Gamma shape of Poisson gaps (1 = Poisson)."),
    max_concurrency: Optional[int] = typer.Option(None, "--max-concurrency", "--concurrency", help="Most in flight."),
    sweep: Optional[str] = typer.Option(None, help="Comma-separated request rates to run one after another."),
    goodput: Optional[str] = typer.Option(None, help="SLOs in ms, e.g. 'ttft:500 tpot:100 e2el:20000'."),
    metric_percentiles: str = typer.Option("50,90,99", help="Percentiles to report."),
    baseline: list[str] = typer.Option([], help="static and/or transformers-cb (repeatable)."),
    baseline_batch_size: Optional[int] = typer.Option(None, help="static: group size (default: the server's slots)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the result JSON here (PNGs beside it)."),
    result_dir: Optional[Path] = typer.Option(None, help="Write result.json and PNG plots into this folder."),
    plot: bool = typer.Option(True, help="Write PNG plots with the JSON."),
    progress: bool = typer.Option(True, help="Progress bar on stderr."),
    ceiling: bool = typer.Option(True, help="After the runs, measure the bare-transformers forward ceiling."),
    model_dir: Optional[str] = typer.Option(None, help="Model dir for baselines/ceiling (default: the server's)."),
    dtype: str = typer.Option(DEFAULTS.dtype, help="dtype for baselines, ceiling and --launch."),
    device: Optional[str] = typer.Option(None, help="Baseline/ceiling device (default: cuda if available)."),
    launch: bool = typer.Option(False, help="Start the server with `python -m launcher` first."),
    launcher_args: str = typer.Option("", help="Extra launcher args (shell-quoted string)."),
    trace_file: Optional[Path] = typer.Option(None, help="With --launch: the router's step trace (for cb-sim)."),
    server_log: Optional[Path] = typer.Option(None, help="With --launch: the server's log goes here."),
):
    url = (url or f"http://127.0.0.1:{port}").rstrip("/")
    plan = Plan([parse_rate(x) for x in sweep.split(",")] if sweep else [parse_rate(request_rate)], arrival, seed,
                burstiness, tuple(float(x) for x in metric_percentiles.split(",")), stats.parse_slos(goodput))
    path = dataset_path if dataset_name != "w64" else (dataset_path or workload)
    reqs = build_workload(dataset_name, path, num_prompts, random_input_len, random_output_len,
                          random_range_ratio, seed, model_dir)
    extra = shlex.split(launcher_args) + (["--trace-file", str(trace_file)] if launch and trace_file else [])
    raw_info, runs = run_server(url, reqs, plan, max_concurrency, progress, backend, label,
                                (port, dtype, extra, url, server_log) if launch else None)
    info = Info.model_validate(raw_info) if raw_info else None
    model_dir = model_dir or (local_model(info.model_id if info else DEFAULTS.model_id) if baseline or ceiling else "")
    baseline, ceiling = (baseline, ceiling) if model_dir else ([], False)  # in-process runs need a local model
    if dtype == "auto" and (baseline or ceiling):  # the in-process runs compute in what the server computed in
        dtype = info.model_dtype if info else local_dtype(device)
    for name in baseline:
        runs += run_baseline(name, reqs, plan, info, model_dir, dtype, device, baseline_batch_size, progress)
    compare_runs(runs, plan.rates, reqs)
    result = {"url": url, "workload": str(path) if path else dataset_name, "dataset": dataset_name, "backend": backend,
              "config": {**plan.config(), "max_concurrency": max_concurrency, "dtype": dtype,
                         "launcher_args": launcher_args},
              "server_info": raw_info, "trace_file": str(trace_file) if trace_file else None,
              **plan.results(runs)}
    if ceiling:
        result["ceiling"] = measure_ceiling(model_dir, dtype, device)
    write_results(result, runs, plan.rates, json_out, result_dir, plot)
    raise typer.Exit(report_mismatches(runs[0]["requests"]))


def report_mismatches(records: list[dict]) -> int:
    """Requests that did not get exactly their forced number of tokens make the run fail (exit 1)."""
    wrong = list(filter(stats.is_mismatch, records))
    for r in wrong:
        typer.echo(f"  id={r['id']} got {r['tokens']}/{r['max_new_tokens']} tokens details={r['generated_tokens']}"
                   f" error={r['error']}", err=True)
    return 1 if wrong else 0


def run_server(url: str, reqs: list[Req], plan: "Plan", max_concurrency: Optional[int], progress: bool,
               backend: str, label: str, launch: Optional[tuple]) -> tuple[dict, list[dict]]:
    """The server's /info (cb's) and one run per rate; `launch`: launch_server's arguments, to start (and stop)
    one."""
    if backend not in client.BACKENDS:
        raise typer.BadParameter(f"--backend {backend!r}: one of {', '.join(client.BACKENDS)}")
    proc = launch_server(*launch) if launch else None
    try:
        protocol = client.backend_for(url, backend)
        return client.server_info(url), [
            plan.run(label, rate, *client.run(url, reqs, plan.arrivals(reqs, rate), max_concurrency, progress,
                                              f"{label} @ {_rate_label(rate)}", protocol)) for rate in plan.rates]
    finally:
        if proc is not None:
            stop_server(proc)  # frees the machine for the baselines and the ceiling


@dataclass
class Plan:
    """The arrivals and the statistics every system in one cb-bench run shares."""
    rates: list[float]
    arrival: str
    seed: int
    burstiness: float
    percentiles: tuple
    slos: dict

    def config(self) -> dict:
        return {"rates": [_rate_label(r) for r in self.rates], "arrival": self.arrival, "seed": self.seed}

    @staticmethod
    def results(runs: list[dict]) -> dict:
        """The first run's summary and records at the top (what cb-sim reads), every run below."""
        return {"summary": runs[0]["summary"], "requests": runs[0]["requests"],
                "runs": [{**r, "rate": _rate_label(r["rate"])} for r in runs]}

    def arrivals(self, reqs: list[Req], rate: float) -> list[float]:
        return arrival_times(len(reqs), rate, self.arrival, self.seed, self.burstiness)

    def run(self, system: str, rate: float, records: list[dict], wall: float) -> dict:
        run = {"system": system, "rate": rate, "wall_s": wall,
               "summary": stats.summarize(records, wall, self.percentiles, self.slos), "requests": records}
        typer.echo(stats.report(run["summary"], self.percentiles, f"{system}, rate {_rate_label(rate)}"))
        return run


def run_baseline(name: str, reqs: list[Req], plan: Plan, info: Optional[Info], model_dir: str, dtype: str,
                 device: Optional[str], batch_size: Optional[int], progress: bool) -> list[dict]:
    """The same workload and arrivals in-process, with the server's cache and budgets when it reported them."""
    if name == "transformers-cb":
        typer.echo("transformers-cb: transformers' own continuous batching (init_continuous_batching, the "
                   "manager behind model.generate_batch), driven per request")
    block_size = info.block_size if info else DEFAULTS.block_size
    num_blocks = info.num_blocks if info else ceil_div(BENCH_TOTAL_TOKENS, block_size)
    prefill = info.max_batch_prefill_tokens if info else DEFAULTS.max_batch_prefill_tokens
    batch = batch_size or min(len(reqs), info.max_batch_size if info else DEFAULTS.max_batch_size)
    label = f"static b{batch}" if name == "static" else name
    return [plan.run(label, rate, *baselines.run(name, reqs, plan.arrivals(reqs, rate), model_dir, dtype, device,
                                                  batch, num_blocks, block_size, prefill, progress))
            for rate in plan.rates]


def compare_runs(runs: list[dict], rates: list[float], reqs: list[Req]) -> None:
    for rate in rates:
        same = [(r["system"], r["summary"]) for r in runs if r["rate"] == rate]
        if len(same) > 1:
            typer.echo(f"\nside by side, rate {_rate_label(rate)} ({describe(reqs)}):")
            typer.echo(stats.side_by_side(same))
    if len(rates) > 1:
        typer.echo("\nsweep:  system  rate  req/s  out tok/s  TTFT p99 ms  E2E p99 ms")
        for r in runs:
            s = r["summary"]
            typer.echo(f"  {r['system']:>16} {_rate_label(r['rate']):>5} {s['req_s']:6.2f} {s['output_tok_s']:9.1f}"
                       f" {s['ttft_p99_ms']:11.1f} {s['e2el_p99_ms']:10.1f}")


def local_dtype(device: Optional[str]) -> str:
    import torch

    from shard.model import resolve_dtype
    return resolve_dtype("auto", torch.device(baselines.local_device(device)))


def measure_ceiling(model_dir: str, dtype: str, device: Optional[str]) -> dict:
    from bench.ceiling import measure_ceiling as measure
    device = baselines.local_device(device)
    c = measure(model_dir, dtype, device)
    typer.echo(f"ceiling ({dtype}, {device}): decode b{c['decode_batch']}@{c['decode_ctx']} "
               f"{c['decode_step_s'] * 1e3:.1f} ms/step = {c['decode_tok_s']:.1f} tok/s; "
               f"prefill {c['prefill_len']} {c['prefill_s'] * 1e3:.1f} ms = {c['prefill_tok_s']:.1f} tok/s")
    return c


def write_results(result: dict, runs: list[dict], rates: list[float], json_out, result_dir, plot: bool) -> None:
    json_path, prefix = _outputs(json_out, result_dir)
    if json_path is None:
        return
    json_path.write_text(json.dumps(result, indent=1, default=str))
    typer.echo(f"result: {json_path}")
    if not plot:
        return
    try:
        from bench import plots
    except ImportError as e:
        typer.echo(f"no plots ({e}): pip install matplotlib", err=True)
        return
    for rate in rates:
        same = [(r["system"], r["requests"]) for r in runs if r["rate"] == rate]
        out = plots.latency_cdfs(same, Path(f"{prefix}_cdf_rate-{_rate_label(rate)}.png"),
                                 f"latency CDFs, rate {_rate_label(rate)} req/s")
        typer.echo(f"plot: {out}")
    if len(rates) > 1:
        series: dict[str, list] = {}
        for r in runs:
            series.setdefault(r["system"], []).append((r["rate"], r["summary"]))
        out = plots.rate_sweep(series, Path(f"{prefix}_sweep.png"), "cb-bench sweep")
        typer.echo(f"plot: {out}")


if __name__ == "__main__":
    app()
