"""cb-sim: the production scheduler and KV manager (router/core), driven by a simulated shard whose step time comes
from a cost model; static batching alongside on the same arrivals.

  cb-sim                                   the worked example: 12 requests, 4 slots, equal step cost
  cb-sim --scenario poisson --plot p.png   Poisson arrivals over a sweep of rates, static vs continuous
  cb-sim --scenario w64 --from-bench r.json   predict a real cb-bench W64 run (its server's settings, and a cost
                                           model calibrated from its --trace-file) and compare with what it measured
  cb-sim --scenario w64 --sweep --ttft-slo-ms 2000 --request-rate 2   which budgets keep p99 TTFT under 2 s?
  cb-sim --replay trace.jsonl --from-bench r.json   check the simulator decides exactly as the live router did
  cb-sim --from-balancer b.json            N replicas behind a balancer (bench.balancer's run), per routing policy

Scheduler settings: a flag given here, else the server's (its /info in --from-bench), else the scenario's, else the
server's defaults.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import typer
from pydantic import ValidationError

from bench.sim import scenarios
from bench.sim.cost_model import CostModel, calibrate, read_trace
from bench.sim.replay import SCHEDULING, replay, simulation_args
from bench.workloads import (DEFAULT_WORKLOAD, arrival_times, describe, load_w64, parse_rate, random_workload,
                             short_requests, worked_example)
from router.api.info import Info
from router.settings import Settings, settings_command

app = typer.Typer(add_completion=False, rich_markup_mode=None, help=__doc__)

EXAMPLE_PUBLISHED = "the example: static 2,200 steps, 48%, mean completion 1,633; continuous 1,150 steps, 92%, 635"
# Small scenarios: 4 slots and room for everything, so only slots limit the batch.
SCENARIO_SETTINGS = {"example": {"max_batch_size": 4, "max_batch_prefill_tokens": 4096,
                                 "max_batch_total_tokens": 1 << 20}}
SCENARIO_SETTINGS["poisson"] = SCENARIO_SETTINGS["example"]
BENCH_TOTAL_TOKENS = 32768  # `make bench`'s --max-batch-total-tokens, when nothing else sizes the pool


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def scheduler_config(given: dict, info: Optional[Info], scenario: str) -> dict:
    """simulate_continuous's scheduler arguments from the flags, the server's /info, the scenario, the defaults."""
    values = {name: getattr(Settings(), name) for name in SCHEDULING}
    values["max_batch_total_tokens"] = BENCH_TOTAL_TOKENS
    values.update({k: getattr(info, k) for k in SCHEDULING} if info else SCENARIO_SETTINGS.get(scenario, {}))
    values.update({k: v for k, v in given.items() if v is not None})
    return simulation_args(values, info.num_swap_blocks if info else 0)


def server_info(bench: dict, path: Optional[Path]) -> Optional[Info]:
    if not bench.get("server_info"):
        return None
    try:
        return Info.model_validate(bench["server_info"])
    except ValidationError as e:
        missing = ", ".join(str(err["loc"][0]) for err in e.errors())
        raise typer.BadParameter(f"{path}: its server's /info lacks {missing} (an older cb-bench wrote it): run "
                                 "cb-bench again, or give the scheduling flags by hand") from None


def cost_model(scenario: str, replaying: bool, bench: dict, cost: Optional[Path], calibrate_from: Optional[Path],
               terms: tuple) -> CostModel:
    """A saved model, else one fitted on a trace, else the per-term flags, else the scenario's default."""
    if cost is not None:
        return CostModel.load(cost)
    if scenario != "example" and not replaying and calibrate_from is None and bench.get("trace_file"):
        calibrate_from = Path(bench["trace_file"])
    if calibrate_from is not None:
        return calibrate(read_trace(calibrate_from), source=f"calibrated on {calibrate_from}")
    if any(x is not None for x in terms):
        step_ms, prefill_token_us, decode_us, kv_token_ns = (x or 0 for x in terms)
        return CostModel(step_ms / 1e3, prefill_token_us / 1e6, decode_us / 1e6, kv_token_ns / 1e9, source="flags")
    if scenario == "example" or replaying:
        return CostModel.steps()
    if scenario in ("w64", "random"):
        typer.echo("note: no cost model given (--from-bench with a trace, --calibrate, --cost or the per-term "
                   "flags): using 2.5 ms per step", err=True)
    return CostModel(0.0025, source="2.5 ms per step")


def describe_setup(model: CostModel, config: dict) -> None:
    typer.echo(f"cost model: {model.describe()}")
    if model.fit:
        f = model.fit
        typer.echo(f"  fit over {f['steps']} traced steps: R² {f['r2']:.3f}, mean |error| per step "
                   f"{f['mean_abs_pct_err']:.1f}%, {f['measured_s']:.2f} s measured vs {f['fitted_s']:.2f} s fitted")
    typer.echo(f"scheduler: {config['budget']}, {config['num_blocks']} blocks x {config['block_size']} tokens, "
               f"{config['policy']}, margin {config['safety_margin']:g}, prefix caching "
               f"{'on' if config['prefix_caching'] else 'off'}")


@app.command()
@settings_command(SCHEDULING, optional=True)
def main(
    settings: dict,
    scenario: str = typer.Option("example", help="example, poisson, w64 or random."),
    workload: Path = typer.Option(DEFAULT_WORKLOAD, help="w64: the workload file."),
    num_prompts: int = typer.Option(400, help="poisson/random: number of requests (per rate)."),
    random_input_len: int = typer.Option(128), random_output_len: int = typer.Option(128),
    random_range_ratio: float = typer.Option(0.5),
    request_rate: str = typer.Option("inf", help="Arrival rate (req/s) for w64/random; inf = all at once."),
    rates: str = typer.Option("2,4,6,8,10,12,14,16", help="poisson: the arrival rates swept."),
    arrival: str = typer.Option("poisson", help="poisson or fixed."),
    seed: int = typer.Option(0),
    from_bench: Optional[Path] = typer.Option(None, help="A cb-bench result JSON: the server's settings (/info), "
                                              "its trace for calibration, its measured time to compare with."),
    calibrate_from: Optional[Path] = typer.Option(None, "--calibrate", help="Fit the cost model on this trace."),
    cost: Optional[Path] = typer.Option(None, help="A cost model JSON (from --save-cost)."),
    save_cost: Optional[Path] = typer.Option(None, help="Write the cost model used here."),
    step_ms: Optional[float] = typer.Option(None, help="Cost model: fixed overhead per step (ms)."),
    prefill_token_us: Optional[float] = typer.Option(None, help="Cost model: per prompt token (µs)."),
    decode_us: Optional[float] = typer.Option(None, help="Cost model: per decoding request (µs)."),
    kv_token_ns: Optional[float] = typer.Option(None, help="Cost model: per KV token read (ns)."),
    static_batch_size: Optional[int] = typer.Option(None, help="Static group size (default: the slots)."),
    sweep: bool = typer.Option(False, help="Sweep the budgets below and answer: which keep p99 TTFT under the SLO?"),
    ttft_slo_ms: float = typer.Option(1000.0, help="--sweep: the p99 TTFT target."),
    sweep_total_tokens: str = typer.Option("2048,4096,8192,16384,32768"),
    sweep_prefill_tokens: str = typer.Option("64,128,256,512,1024,2048"),
    replay_trace: Optional[Path] = typer.Option(None, "--replay", help="Replay a live trace; compare decisions."),
    from_balancer: Optional[Path] = typer.Option(None, help="A bench.balancer result JSON: simulate its replicas "
                                                 "under each of --routing, its workload, client and settings, and "
                                                 "compare with what it measured."),
    replicas: Optional[int] = typer.Option(None, help="Replicas behind a balancer (default: --from-balancer's)."),
    routing: str = typer.Option("round_robin,least_loaded,cache_aware", help="With --from-balancer: the routing "
                                "policies simulated (replicas.py)."),
    plot: Optional[Path] = typer.Option(None, help="Write a PNG plot here."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON here."),
):
    if from_balancer is not None:
        raise typer.Exit(run_balancer(from_balancer, settings, replicas, routing, calibrate_from, cost, json_out))
    bench = json.loads(from_bench.read_text()) if from_bench else {}
    info = server_info(bench, from_bench)
    config = scheduler_config(settings, info, scenario)
    model = cost_model(scenario, replay_trace is not None, bench, cost, calibrate_from,
                       (step_ms, prefill_token_us, decode_us, kv_token_ns))
    if save_cost:
        model.save(save_cost)
    describe_setup(model, config)
    result: dict = {"scenario": scenario, "cost_model": model.__dict__, "budget": dataclasses.asdict(config["budget"]),
                    "num_blocks": config["num_blocks"], "block_size": config["block_size"]}
    if replay_trace is not None:
        raise typer.Exit(run_replay(replay_trace, model, config))
    static_batch = static_batch_size or config["budget"].max_batch_size
    if scenario == "poisson":
        run_rate_sweep(num_prompts, seed, _ints(rates), config, model, static_batch, arrival, plot, result)
    else:
        reqs = workload_of(scenario, workload, num_prompts, random_input_len, random_output_len,
                           random_range_ratio, seed)
        times = arrival_times(len(reqs), parse_rate(request_rate), arrival, seed)
        typer.echo(f"workload: {scenario} ({describe(reqs)}), arrivals {request_rate} req/s")
        if sweep:
            run_budget_sweep(reqs, times, config, model, _ints(sweep_total_tokens), _ints(sweep_prefill_tokens),
                             ttft_slo_ms, plot, result)
        else:
            run_compare(scenario, reqs, times, config, model, static_batch, bench, plot, result)
    if json_out:
        json_out.write_text(json.dumps(result, indent=1, default=str))


def run_balancer(path: Path, settings: dict, replicas: Optional[int], routing: str, calibrate_from: Optional[Path],
                 cost: Optional[Path], json_out: Optional[Path]) -> int:
    """bench.balancer's run again in the simulator: each replica from the measured server's /info, the cost model
    from a replica's trace, the same passages (tokenized as the router does) and the same client."""
    from transformers import AutoTokenizer

    from bench.sim.replicas import scheduler_factory, simulate_replicas
    from bench.workloads import shared_prefix_workload
    from launcher.model_files import resolve_model

    run = json.loads(path.read_text())
    info = server_info(run, path)
    if info is None:
        raise typer.BadParameter(f"{path}: no server_info (run bench.balancer again)")
    config = scheduler_config(settings, info, "balancer")
    if calibrate_from is None and cost is None and run.get("traces"):
        calibrate_from = Path(run["traces"]) / "replica-0.jsonl"
    model = cost_model("balancer", False, {}, cost, calibrate_from, (None,) * 4)
    describe_setup(model, config)
    calibration = read_trace(calibrate_from)[0].get("calibration") if calibrate_from else None
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(info.model_id))
    n = replicas or run["replicas"]
    measured = run.get("policies", {})
    out = {}
    for policy in routing.split(","):
        seed = list(measured).index(policy) if policy in measured else len(measured)
        reqs = shared_prefix_workload(run["docs"], run["questions"], run["doc_words"], run["max_new_tokens"], seed)
        for r in reqs:
            r.prompt_ids = tokenizer(r.text, add_special_tokens=True)["input_ids"]
            r.prompt_tokens = len(r.prompt_ids)
        sim, extra = simulate_replicas(reqs, n, policy, run["concurrency"], scheduler_factory(config, calibration),
                                       model)
        s = {**sim.summary(), **extra}
        line = (f"{policy:>12}: predicted {s['output_tok_s']:.1f} tok/s out, hit rate {s['hit_rate']:.1%}, spread "
                f"{s['served_per_replica']}, TTFT mean {s['ttft_mean_ms']:.0f} ms")
        if policy in measured and n == run["replicas"]:
            m = measured[policy]
            s["measured"] = {k: m[k] for k in ("output_tok_s", "hit_rate", "ttft_mean_ms", "served_per_replica")}
            s["throughput_error"] = s["output_tok_s"] / m["output_tok_s"] - 1
            line += (f"; measured {m['output_tok_s']:.1f} tok/s ({s['throughput_error']:+.1%}), hit rate "
                     f"{m['hit_rate']:.1%}, spread {m['served_per_replica']}, TTFT mean {m['ttft_mean_ms']:.0f} ms")
        typer.echo(line)
        out[policy] = s
    if json_out:
        json_out.write_text(json.dumps({"replicas": n, "cost_model": model.__dict__, "policies": out}, indent=1,
                                       default=str))
    return 0


def workload_of(scenario: str, workload: Path, n: int, input_len: int, output_len: int, ratio: float, seed: int):
    if scenario == "example":
        return worked_example()
    if scenario == "w64":
        return load_w64(workload)
    if scenario == "random":
        return random_workload(n, input_len, output_len, ratio, seed)
    raise typer.BadParameter(f"unknown scenario {scenario!r}: example, poisson, w64 or random")


def run_replay(trace: Path, model: CostModel, config: dict) -> int:
    lines = read_trace(trace)
    diffs, sim = replay(lines, cost=model, **config)
    typer.echo(f"replayed {len(lines)} traced steps ({len(sim.records)} requests) through the production "
               f"scheduler: {'identical decisions' if not diffs else f'{len(diffs)} differences'}")
    for d in diffs[:20]:
        typer.echo(f"  {d}")
    return 1 if diffs else 0


def run_rate_sweep(n: int, seed: int, rates: list[int], config: dict, model: CostModel, static_batch: int,
                   arrival: str, plot: Optional[Path], result: dict) -> None:
    series = scenarios.rate_sweep(lambda: short_requests(n, seed), [float(r) for r in rates], config, model,
                                  static_batch, arrival, seed)
    typer.echo(f"poisson: {n} requests per rate, prompts 10 tokens, outputs 10..200, "
               f"{config['budget'].max_batch_size} slots")
    typer.echo(scenarios.format_rate_sweep(series))
    result["rate_sweep"] = {k: [(r, s) for r, s in v] for k, v in series.items()}
    if plot:
        from bench.plots import rate_sweep
        rate_sweep(series, plot, "static vs continuous under Poisson arrivals", latency_key="mean_wait_ms",
                   latency_label="mean queue wait (ms)", throughput_key="req_s", throughput_label="completed req/s")
        typer.echo(f"plot: {plot}")


def run_budget_sweep(reqs, times, config: dict, model: CostModel, totals: list[int], prefills: list[int],
                     slo_ms: float, plot: Optional[Path], result: dict) -> None:
    table = scenarios.budget_sweep(reqs, times, config, model, totals, prefills)
    typer.echo(scenarios.format_budget_sweep(table, slo_ms, max(r.prompt_tokens for r in reqs)))
    result["budget_sweep"] = [{"max_batch_total_tokens": t, "max_batch_prefill_tokens": p, **s}
                              for (t, p), s in table.items()]
    if plot:
        from bench.plots import budget_heatmap
        budget_heatmap(totals, prefills, {k: s["ttft_p99_ms"] for k, s in table.items()}, slo_ms, plot)
        typer.echo(f"plot: {plot}")


def run_compare(scenario: str, reqs, times, config: dict, model: CostModel, static_batch: int, bench: dict,
                plot: Optional[Path], result: dict) -> None:
    static, cont = scenarios.compare(reqs, times, config, model, static_batch)
    typer.echo(scenarios.format_compare([static, cont], model))
    if scenario == "example":
        typer.echo(f"({EXAMPLE_PUBLISHED}; mean completion {static.mean_completion / cont.mean_completion:.2f}x "
                   "sooner)")
    result["static"], result["continuous"] = static.summary(), cont.summary()
    measured = (bench.get("summary") or {}).get("wall_s")
    if measured and scenario == "w64":
        err = (cont.total - measured) / measured
        typer.echo(f"\nprediction: cb-sim {cont.total:.2f} s vs cb-bench measured {measured:.2f} s ({err:+.1%})")
        result["prediction"] = {"predicted_s": cont.total, "measured_s": measured, "error": err}
    if plot:
        from bench.plots import latency_cdfs
        latency_cdfs([("static", static.records), ("continuous", cont.records)], plot,
                     f"cb-sim {scenario}: {model.describe()}")
        typer.echo(f"plot: {plot}")


if __name__ == "__main__":
    app()
