"""Replays a live router trace (`cb-launcher --trace-file`) through the simulator and checks that it makes the same
scheduling decisions, step by step: the same entries (request, start, tokens, sample), the same preemptions and
the same retirements. Each traced arrival enters the simulator just before the schedule() call whose line lists
it; a request the trace shows retired with fewer tokens than asked (EOS, stop sequence, client gone) is given
that many as its length, so the simulator retires it at the same step by its own rule. The trace has lengths, not
token ids: requests that shared a prompt prefix live would not share it here (benchmarks send random ids).
"""
from __future__ import annotations

from bench.sim.cost_model import CostModel
from bench.sim.simulator import SimResult, simulate_continuous
from bench.workloads import Req
from router.api.info import Info
from router.core.allocator import ceil_div
from router.core.scheduler import Budget
from router.settings import Settings


def trace_requests(lines: list[dict]) -> tuple[list[Req], list[int]]:
    """The traced arrivals as simulator requests, and the schedule() call each arrives before."""
    generated = {i: n for line in lines for i, n in line["finished"]}
    reqs, at_steps = [], []
    for k, line in enumerate(lines):
        for a in line["arrivals"]:
            reqs.append(Req(a["id"], a["prompt_tokens"], generated.get(a["id"], a["max_new_tokens"])))
            at_steps.append(k)
    return reqs, at_steps


# The settings that shape scheduling decisions (their names in router/settings.py and in /info).
SCHEDULING = ("max_batch_size", "max_batch_prefill_tokens", "max_batch_total_tokens", "waiting_served_ratio",
              "max_waiting_tokens", "block_size", "num_blocks", "prefix_caching", "scheduler", "safety_margin",
              "prefill_step_ratio")


def simulation_args(values: dict, swap_blocks: int = 0) -> dict:
    """simulate_continuous's (and replay's) scheduler arguments from scheduling settings; with no num_blocks the
    pool is sized from the total-token budget, as the router does."""
    total, bs = values["max_batch_total_tokens"], values["block_size"]
    margin = Settings(scheduler=values["scheduler"], safety_margin=values["safety_margin"]).margin
    return {"budget": Budget(values["max_batch_prefill_tokens"], total, values["max_batch_size"],
                             values["waiting_served_ratio"], values["max_waiting_tokens"]),
            "num_blocks": values["num_blocks"] or ceil_div(total, bs), "block_size": bs,
            "prefix_caching": values["prefix_caching"], "policy": values["scheduler"], "safety_margin": margin,
            "swap_blocks": swap_blocks, "prefill_step_ratio": values["prefill_step_ratio"]}


def server_config(info: Info) -> dict:
    """How a live server ran its scheduler (its /info), as simulation_args."""
    return simulation_args({k: getattr(info, k) for k in SCHEDULING}, info.num_swap_blocks)


def replay(lines: list[dict], budget: Budget, num_blocks: int, block_size: int,
           cost: CostModel | None = None, prefix_caching: bool = True, **options) -> tuple[list[str], SimResult]:
    """Returns (differences, the simulation); no differences means identical decisions at every step.
    `options`: the traced server's policy, safety_margin and swap_blocks (see server_config)."""
    reqs, at_steps = trace_requests(lines)
    sim = simulate_continuous(reqs, budget, num_blocks, block_size, cost, at_steps=at_steps, record=True,
                              prefix_caching=prefix_caching, took=[line.get("took") for line in lines],
                              calibration=lines[0].get("calibration") if lines else None, **options)
    diffs = []
    for k, (live, mine) in enumerate(zip(lines, sim.decisions)):
        for key in ("entries", "preempted", "offloaded", "restored", "finished"):
            want = [list(x) for x in live.get(key, [])] if key in ("entries", "finished") else live.get(key, [])
            got = mine[key]
            if key == "finished":
                want, got = sorted(want), sorted(got)
            if want != got:
                diffs.append(f"step {k}: {key} live {want} vs simulated {got}")
    if len(lines) != len(sim.decisions):
        diffs.append(f"live trace has {len(lines)} steps, simulator {len(sim.decisions)}")
    return diffs, sim
