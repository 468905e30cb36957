"""What cb-sim runs: static vs continuous on one set of arrivals, a sweep of Poisson arrival rates, and a sweep
of the batch budgets against a p99 TTFT target (the operator's question). Pure Python."""
from __future__ import annotations

import math
from dataclasses import replace

from bench.sim.cost_model import CostModel
from bench.sim.simulator import SimResult, simulate_continuous, simulate_static
from bench.workloads import Req, arrival_times
from router.core.allocator import ceil_div


def compare(reqs: list[Req], times: list[float], config: dict, cost: CostModel,
            static_batch: int) -> tuple[SimResult, SimResult]:
    """`config`: simulate_continuous's scheduler arguments (budget, num_blocks, block_size, prefix_caching...)."""
    static = simulate_static(reqs, static_batch, cost, times)
    continuous = simulate_continuous(reqs, cost=cost, times=times, **config)
    return static, continuous


def _t(x: float, steps: bool) -> str:
    return f"{x:.0f}" if steps else f"{x:.2f} s"


def _ms(x: float, steps: bool) -> str:
    return "-" if math.isnan(x) else (f"{x / 1e3:.1f}" if steps else f"{x:.1f} ms")


def format_compare(results: list[SimResult], cost: CostModel, percentiles=(50, 99)) -> str:
    """The static-vs-continuous table. Under the unit cost model times are in steps (summaries hold step/1000 as
    'ms' since they are computed in seconds, hence the /1e3 above)."""
    steps = cost.is_steps
    sums = [r.summary(percentiles) for r in results]
    rows = [("total " + ("(steps)" if steps else "time"), [_t(s["total"], steps) for s in sums]),
            ("forward steps", [str(s["steps"]) for s in sums]),
            ("slot utilisation", [f"{s['utilisation']:.1%}" for s in sums]),
            ("mean completion", [_t(s["mean_completion"], steps) for s in sums]),
            ("mean queue wait", [_t(s["mean_wait"], steps) for s in sums]),
            ("output tokens / " + ("step" if steps else "s"), [f"{s['output_tok_s']:.2f}" for s in sums])]
    for m, label in (("ttft", "TTFT"), ("itl", "ITL")):
        for q in percentiles:
            rows.append((f"{label} p{q:g}", [_ms(s[f"{m}_p{q:g}_ms"], steps) for s in sums]))
    rows.append(("peak KV blocks", [str(s["peak_blocks"]) if s["policy"] != "static" else "-" for s in sums]))
    rows.append(("soft resets (preemptions)", [str(s["preemptions"]) if s["policy"] != "static" else "-"
                                               for s in sums]))
    names = [f"{r.policy} ({r.slots} slots)" for r in results]
    width = max(18, *(len(n) + 2 for n in names))
    lines = ["".ljust(27) + "".join(n.rjust(width) for n in names)]
    lines += [label.ljust(27) + "".join(c.rjust(width) for c in cells) for label, cells in rows]
    return "\n".join(lines)


def rate_sweep(make_reqs, rates: list[float], config: dict, cost: CostModel, static_batch: int,
               process: str = "poisson", seed: int = 0) -> dict[str, list[tuple[float, dict]]]:
    """{policy: [(rate, summary)]}: throughput (completed req/s), mean queue wait, p99 TTFT at each arrival rate."""
    out: dict[str, list[tuple[float, dict]]] = {"static": [], "continuous": []}
    for rate in rates:
        reqs = make_reqs()
        times = arrival_times(len(reqs), rate, process, seed)
        for res in compare(reqs, times, config, cost, static_batch):
            s = res.summary()
            s["mean_wait_ms"] = s["mean_wait"] * 1e3
            s["mean_batch"] = res.generated / res.steps if res.steps else 0.0
            out[res.policy].append((rate, s))
    return out


def format_rate_sweep(series: dict[str, list[tuple[float, dict]]]) -> str:
    lines = ["rate req/s  policy       req/s  mean wait s  p99 TTFT s  mean batch  utilisation"]
    for (rate, s), (_, c) in zip(series["static"], series["continuous"]):
        for name, x in (("static", s), ("continuous", c)):
            lines.append(f"{rate:10g}  {name:<10} {x['req_s']:7.2f} {x['mean_wait']:12.2f} "
                         f"{x['ttft_p99_ms'] / 1e3:11.2f} {x['mean_batch']:11.2f} {x['utilisation']:12.1%}")
    return "\n".join(lines)


def budget_sweep(reqs: list[Req], times: list[float], config: dict, cost: CostModel, totals: list[int],
                 prefills: list[int]) -> dict[tuple[int, int], dict]:
    """Continuous batching under every (--max-batch-total-tokens, --max-batch-prefill-tokens): the KV pool is sized
    from the total budget, as the router does when that flag is given."""
    out = {}
    for total in totals:
        for prefill in prefills:
            budget = replace(config["budget"], max_batch_total_tokens=total, max_batch_prefill_tokens=prefill)
            res = simulate_continuous(reqs, cost=cost, times=times, **{
                **config, "budget": budget, "num_blocks": ceil_div(total, config["block_size"])})
            out[(total, prefill)] = res.summary()
    return out


def format_budget_sweep(table: dict[tuple[int, int], dict], slo_ms: float, max_prompt: int) -> str:
    lines = ["total tokens  prefill tokens  p99 TTFT ms  p50 TTFT ms  p99 ITL ms  out tok/s  resets  meets SLO"]
    for (total, prefill), s in sorted(table.items()):
        ok = s["ttft_p99_ms"] <= slo_ms
        lines.append(f"{total:12d}  {prefill:14d}  {s['ttft_p99_ms']:11.1f}  {s['ttft_p50_ms']:11.1f}  "
                     f"{s['itl_p99_ms']:10.1f}  {s['output_tok_s']:9.1f}  {s['preemptions']:6d}  {'yes' if ok else 'no'}")
    good = [(k, s) for k, s in table.items() if s["ttft_p99_ms"] <= slo_ms]
    if not good:
        lines.append(f"\nno configuration keeps p99 TTFT under {slo_ms:g} ms for this traffic: the machine is too slow "
                     f"for it, or the rate is too high (try fewer requests per second).")
        return "\n".join(lines)
    smallest = min(k[0] for k, _ in good)
    at_smallest = [(k, s) for k, s in good if k[0] == smallest]
    best = max(s["output_tok_s"] for _, s in at_smallest)  # within 1% of the best throughput, the lowest p99 TTFT
    (total, prefill), s = min(((k, s) for k, s in at_smallest if s["output_tok_s"] >= 0.99 * best),
                              key=lambda x: x[1]["ttft_p99_ms"])
    lines.append(f"\nanswer: the smallest --max-batch-total-tokens keeping p99 TTFT under {slo_ms:g} ms is {smallest}; "
                 f"with it, --max-batch-prefill-tokens {prefill} gives the most throughput "
                 f"({s['output_tok_s']:.1f} tok/s, p99 TTFT {s['ttft_p99_ms']:.0f} ms).")
    if prefill < max_prompt:
        lines.append(f"(prompts up to {max_prompt} tokens are chunked at that prefill budget)")
    return "\n".join(lines)
