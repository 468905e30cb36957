"""cb-sim: the production scheduler (router/scheduler.py) and block table, driven by a simulated shard whose step
time comes from a cost model; static batching alongside on the same arrivals.

  cb-sim                                   seed 004's worked example: 12 requests, 4 slots, equal step cost
  cb-sim --scenario seed002 --plot p.png   seed 002's exercise: Poisson arrivals over a sweep of rates
  cb-sim --scenario w64 --from-bench r.json   predict a real cb-bench W64 run (its server's budgets, and a cost
                                           model calibrated from its --trace-file) and compare with what it measured
  cb-sim --scenario w64 --sweep --ttft-slo-ms 2000 --request-rate 2   which budgets keep p99 TTFT under 2 s?
  cb-sim --replay trace.jsonl --from-bench r.json   check the simulator decides exactly as the live router did
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from launcher import scenarios
from launcher.cost_model import CostModel, calibrate, read_trace
from launcher.replay import replay, scheduler_options
from launcher.workloads import (DEFAULT_WORKLOAD, arrival_times, describe, load_w64, parse_rate, random_workload,
                                seed002, seed004)
from router.scheduler import Budget

app = typer.Typer(add_completion=False, help=__doc__)

SEED004_PUBLISHED = "seed 004: static 2,200 steps, 48%, mean completion 1,633; continuous 1,150 steps, 92%, 635"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _cost(cost: Optional[Path], calibrate_from: Optional[Path], bench: dict, step_ms, prefill_token_us, decode_us,
          kv_token_ns, default: CostModel) -> CostModel:
    if cost is not None:
        return CostModel.load(cost)
    trace = calibrate_from or (Path(bench["trace_file"]) if bench.get("trace_file") else None)
    if trace is not None:
        return calibrate(read_trace(trace), source=f"calibrated on {trace}")
    if any(x is not None for x in (step_ms, prefill_token_us, decode_us, kv_token_ns)):
        return CostModel((step_ms or 0) / 1e3, (prefill_token_us or 0) / 1e6, (decode_us or 0) / 1e6,
                         (kv_token_ns or 0) / 1e9, source="flags")
    return default


@app.command()
def main(
    scenario: str = typer.Option("seed004", help="seed004, seed002, w64 or random."),
    workload: Path = typer.Option(DEFAULT_WORKLOAD, help="w64: the workload file."),
    num_prompts: int = typer.Option(400, help="seed002/random: number of requests (per rate)."),
    random_input_len: int = typer.Option(128), random_output_len: int = typer.Option(128),
    random_range_ratio: float = typer.Option(0.5),
    request_rate: str = typer.Option("inf", help="Arrival rate (req/s) for w64/random; inf = all at once."),
    rates: str = typer.Option("2,4,6,8,10,12,14,16", help="seed002: the arrival rates swept."),
    arrival: str = typer.Option("poisson", help="poisson or fixed."),
    seed: int = typer.Option(0),
    from_bench: Optional[Path] = typer.Option(None, help="A cb-bench result JSON: the server's budgets (/info), its "
                                              "trace for calibration, its measured time to compare with."),
    calibrate_from: Optional[Path] = typer.Option(None, "--calibrate", help="Fit the cost model on this trace."),
    cost: Optional[Path] = typer.Option(None, help="A cost model JSON (from --save-cost)."),
    save_cost: Optional[Path] = typer.Option(None, help="Write the cost model used here."),
    step_ms: Optional[float] = typer.Option(None, help="Cost model: fixed overhead per step (ms)."),
    prefill_token_us: Optional[float] = typer.Option(None, help="Cost model: per prompt token (µs)."),
    decode_us: Optional[float] = typer.Option(None, help="Cost model: per decoding request (µs)."),
    kv_token_ns: Optional[float] = typer.Option(None, help="Cost model: per KV token read (ns)."),
    max_batch_size: Optional[int] = typer.Option(None, help="Slots (seed scenarios: 4; else the server's, or 64)."),
    static_batch_size: Optional[int] = typer.Option(None, help="Static group size (default: the slots)."),
    max_batch_prefill_tokens: Optional[int] = typer.Option(None), max_batch_total_tokens: Optional[int] = typer.Option(None),
    waiting_served_ratio: Optional[float] = typer.Option(None), max_waiting_tokens: Optional[int] = typer.Option(None),
    block_size: Optional[int] = typer.Option(None), num_blocks: Optional[int] = typer.Option(None),
    sweep: bool = typer.Option(False, help="Sweep the budgets below and answer: which keep p99 TTFT under the SLO?"),
    ttft_slo_ms: float = typer.Option(1000.0, help="--sweep: the p99 TTFT target."),
    sweep_total_tokens: str = typer.Option("2048,4096,8192,16384,32768"),
    sweep_prefill_tokens: str = typer.Option("64,128,256,512,1024,2048"),
    replay_trace: Optional[Path] = typer.Option(None, "--replay", help="Replay a live trace; compare decisions."),
    prefix_caching: bool = typer.Option(True, help="As the server's --prefix-caching (on by default there)."),
    plot: Optional[Path] = typer.Option(None, help="Write a PNG plot here."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON here."),
):
    bench = json.loads(from_bench.read_text()) if from_bench else {}
    info = bench.get("server_info") or {}
    seeds = scenario in ("seed004", "seed002") and not info  # else the server's /info, as a replay needs
    slots = max_batch_size or (4 if seeds else int(info.get("max_batch_size", 64)))
    bs = block_size or int(info.get("block_size", 16))
    total = max_batch_total_tokens or int(info.get("max_batch_total_tokens", 1 << 20 if seeds else 32768))
    budget = Budget(max_batch_prefill_tokens or int(info.get("max_batch_prefill_tokens", 4096 if seeds else 512)),
                    total, slots,
                    waiting_served_ratio if waiting_served_ratio is not None else float(info.get("waiting_served_ratio", 0.3)),
                    max_waiting_tokens if max_waiting_tokens is not None else int(info.get("max_waiting_tokens", 20)))
    blocks = num_blocks or int(info.get("num_blocks", -(-total // bs)))
    default = CostModel.steps() if scenario == "seed004" or replay_trace else CostModel(0.0025, source="2.5 ms per step")
    model = _cost(cost, calibrate_from, bench if scenario != "seed004" and not replay_trace else {}, step_ms,
                  prefill_token_us, decode_us, kv_token_ns, default)
    if scenario in ("w64", "random") and model is default and not replay_trace:
        typer.echo("note: no cost model given (--from-bench with a trace, --calibrate, --cost or the per-term "
                   "flags): using 2.5 ms per step", err=True)
    if save_cost:
        model.save(save_cost)
    typer.echo(f"cost model: {model.describe()}")
    if model.fit:
        f = model.fit
        typer.echo(f"  fit over {f['steps']} traced steps: R² {f['r2']:.3f}, mean |error| per step "
                   f"{f['mean_abs_pct_err']:.1f}%, {f['measured_s']:.2f} s measured vs {f['fitted_s']:.2f} s fitted")
    typer.echo(f"scheduler: {budget}, {blocks} blocks x {bs} tokens")
    result: dict = {"scenario": scenario, "cost_model": model.__dict__, "budget": budget.__dict__,
                    "num_blocks": blocks, "block_size": bs}

    if replay_trace is not None:
        lines = read_trace(replay_trace)
        diffs, sim = replay(lines, budget, blocks, bs, model, prefix_caching, **scheduler_options(info))
        typer.echo(f"replayed {len(lines)} traced steps ({len(sim.records)} requests) through the production "
                   f"scheduler: {'identical decisions' if not diffs else f'{len(diffs)} differences'}")
        for d in diffs[:20]:
            typer.echo(f"  {d}")
        raise typer.Exit(1 if diffs else 0)

    if scenario == "seed002":
        make = lambda: seed002(num_prompts, seed)  # noqa: E731
        series = scenarios.rate_sweep(make, [float(r) for r in rates.split(",")], budget, blocks, bs, model,
                                      static_batch_size or slots, arrival, seed, prefix_caching)
        typer.echo(f"seed 002: {num_prompts} requests per rate, prompts 10 tokens, outputs 10..200, {slots} slots")
        typer.echo(scenarios.format_rate_sweep(series))
        result["rate_sweep"] = {k: [(r, s) for r, s in v] for k, v in series.items()}
        if plot:
            from launcher.plots import rate_sweep
            rate_sweep(series, plot, "seed 002: static vs continuous under Poisson arrivals",
                       latency_key="mean_wait_ms", latency_label="mean queue wait (ms)",
                       throughput_key="req_s", throughput_label="completed req/s")
            typer.echo(f"plot: {plot}")
    else:
        if scenario == "seed004":
            reqs = seed004()
        elif scenario == "w64":
            reqs = load_w64(workload)
        elif scenario == "random":
            reqs = random_workload(num_prompts, random_input_len, random_output_len, random_range_ratio, seed)
        else:
            raise typer.BadParameter(f"unknown scenario {scenario!r}")
        rate = parse_rate(request_rate)
        times = arrival_times(len(reqs), rate, arrival, seed)
        typer.echo(f"workload: {scenario} ({describe(reqs)}), arrivals {request_rate} req/s")
        if sweep:
            totals, prefills = _ints(sweep_total_tokens), _ints(sweep_prefill_tokens)
            table = scenarios.budget_sweep(reqs, times, budget, bs, model, totals, prefills, prefix_caching)
            typer.echo(scenarios.format_budget_sweep(table, ttft_slo_ms, max(r.prompt_tokens for r in reqs)))
            result["budget_sweep"] = [{"max_batch_total_tokens": t, "max_batch_prefill_tokens": p, **s}
                                      for (t, p), s in table.items()]
            if plot:
                from launcher.plots import budget_heatmap
                budget_heatmap(totals, prefills, {k: s["ttft_p99_ms"] for k, s in table.items()}, ttft_slo_ms, plot)
                typer.echo(f"plot: {plot}")
        else:
            static, cont = scenarios.compare(reqs, times, budget, blocks, bs, model, static_batch_size or slots,
                                             prefix_caching)
            typer.echo(scenarios.format_compare([static, cont], model))
            if scenario == "seed004":
                typer.echo(f"({SEED004_PUBLISHED}; mean completion {static.mean_completion / cont.mean_completion:.2f}x "
                           f"sooner)")
            result["static"], result["continuous"] = static.summary(), cont.summary()
            measured = (bench.get("summary") or {}).get("wall_s")
            if measured and scenario == "w64":
                err = (cont.total - measured) / measured
                typer.echo(f"\nprediction: cb-sim {cont.total:.2f} s vs cb-bench measured {measured:.2f} s "
                           f"({err:+.1%})")
                result["prediction"] = {"predicted_s": cont.total, "measured_s": measured, "error": err}
            if plot:
                from launcher.plots import latency_cdfs
                latency_cdfs([("static", static.records), ("continuous", cont.records)], plot,
                             f"cb-sim {scenario}: {model.describe()}")
                typer.echo(f"plot: {plot}")
    if json_out:
        json_out.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    app()
