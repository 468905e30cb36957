"""Replays a live router trace (`cb-launcher --trace-file`) through the simulator and checks that it makes the same
scheduling decisions, step by step: the same entries (request, start, tokens, sample), the same preemptions and
the same retirements. Each traced arrival enters the simulator just before the schedule() call whose line lists
it; a request the trace shows retired with fewer tokens than asked (EOS, stop sequence, client gone) is given
that many as its length, so the simulator retires it at the same step by its own rule. The trace has lengths, not
token ids: requests that shared a prompt prefix live would not share it here (benchmarks send random ids).
"""
from __future__ import annotations

from launcher.cost_model import CostModel
from launcher.simulator import SimResult, simulate_continuous
from launcher.workloads import Req
from router.scheduler import Budget


def trace_requests(lines: list[dict]) -> tuple[list[Req], list[int]]:
    """The traced arrivals as simulator requests, and the schedule() call each arrives before."""
    generated = {i: n for line in lines for i, n in line["finished"]}
    reqs, at_steps = [], []
    for k, line in enumerate(lines):
        for a in line["arrivals"]:
            reqs.append(Req(a["id"], a["prompt_tokens"], generated.get(a["id"], a["max_new_tokens"])))
            at_steps.append(k)
    return reqs, at_steps


def budget_from_info(info: dict) -> tuple[Budget, int, int]:
    """The scheduler configuration a live server reports in /info: (Budget, num_blocks, block_size)."""
    budget = Budget(int(info["max_batch_prefill_tokens"]), int(info["max_batch_total_tokens"]),
                    int(info["max_batch_size"]), float(info["waiting_served_ratio"]), int(info["max_waiting_tokens"]))
    return budget, int(info["num_blocks"]), int(info["block_size"])


def scheduler_options(info: dict) -> dict:
    """The policy, safety margin and swap pool a live server reports in /info (older servers: none)."""
    return {"policy": info.get("scheduler", "fifo"), "safety_margin": float(info.get("safety_margin", 0.0)),
            "swap_blocks": int(info.get("num_swap_blocks", 0))}


def replay(lines: list[dict], budget: Budget, num_blocks: int, block_size: int,
           cost: CostModel | None = None, prefix_caching: bool = True, **options) -> tuple[list[str], SimResult]:
    """Returns (differences, the simulation); no differences means identical decisions at every step.
    `options`: scheduler_options() of the traced server."""
    reqs, at_steps = trace_requests(lines)
    sim = simulate_continuous(reqs, budget, num_blocks, block_size, cost, at_steps=at_steps, record=True,
                              prefix_caching=prefix_caching, **options)
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
