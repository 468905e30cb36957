"""N replicas behind a balancer, simulated: each replica is the production scheduler and KV manager on a simulated
shard (simulator.py), and a routing policy sends each request to one of them when the client sends it. The client
is the one bench/balancer.py runs: the requests in order, at most `concurrency` in flight, the next sent as one
finishes, so a replica's speed decides when the next request comes.

Policies, as the balancers name them:
- round_robin: the replicas in turn.
- least_loaded: the replica with the fewest requests in flight (vLLM router's and SGLang's "shortest queue").
- cache_aware: SGLang's: the replica whose past prompts share the longest prefix with this one, when that prefix is
  over CACHE_THRESHOLD of the prompt, else the replica holding the fewest prompt tokens; unless the loads differ
  by more than BALANCE_ABS (and the largest is over BALANCE_REL times the smallest): then the least loaded. SGLang
  matches text in a radix tree; this matches token ids, which is what a replica's prefix cache reuses.
"""
from __future__ import annotations

import heapq
from typing import Callable, Optional

from bench.sim.cost_model import CostModel
from bench.sim.simulator import SimResult, _clean, _Continuous, prompt_ids
from bench.workloads import Req
from router.core.kv import KVManager
from router.core.pacing import pacer
from router.core.scheduler import Scheduler

CACHE_THRESHOLD, BALANCE_ABS, BALANCE_REL = 0.3, 32, 1.0001  # sglang-router 0.3.2's defaults
ROUTING = ("round_robin", "least_loaded", "cache_aware")


def _shared(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Router:
    """Picks a replica for each prompt; told when a request finishes."""

    def __init__(self, policy: str, replicas: int):
        if policy not in ROUTING:
            raise ValueError(f"unknown routing policy {policy!r}: {', '.join(ROUTING)}")
        self.policy, self.n = policy, replicas
        self.turn = 0
        self.load = [0] * replicas
        self.prompts: list[list[list[int]]] = [[] for _ in range(replicas)]
        self.held = [0] * replicas

    def least_loaded(self) -> int:
        return min(range(self.n), key=lambda r: (self.load[r], r))

    def pick(self, ids: list[int]) -> int:
        if self.policy == "round_robin":
            r, self.turn = self.turn, (self.turn + 1) % self.n
        elif self.policy == "least_loaded":
            r = self.least_loaded()
        else:
            lo, hi = min(self.load), max(self.load)
            if hi - lo > BALANCE_ABS and hi > lo * BALANCE_REL:
                r = self.least_loaded()
            else:
                match = [max((_shared(ids, p) for p in self.prompts[k]), default=0) for k in range(self.n)]
                best = max(range(self.n), key=lambda k: (match[k], -k))
                r = best if ids and match[best] / len(ids) > CACHE_THRESHOLD else \
                    min(range(self.n), key=lambda k: (self.held[k], k))
            self.prompts[r].append(ids)
            self.held[r] += len(ids)
        self.load[r] += 1
        return r

    def finished(self, r: int) -> None:
        self.load[r] -= 1


def simulate_replicas(reqs: list[Req], replicas: int, policy: str, concurrency: int,
                      make_scheduler: Callable[[], Scheduler], cost: CostModel) -> tuple[SimResult, dict]:
    """The whole run as one SimResult (records of every replica; total = the last token's time), and what the
    balancer's measurement reports beside it: how many requests each replica served, and the prefix-cache hit
    rate (tokens reused over prompt tokens, every replica together)."""
    router = Router(policy, replicas)
    times: list[float] = [0.0] * len(reqs)  # each request's send time, set when it is sent
    sims = [_Continuous(reqs, make_scheduler(), cost, times, None, False) for _ in range(replicas)]
    where: dict[int, int] = {}
    served = [0] * replicas
    slots = [0.0] * min(concurrency, len(reqs))  # when each client slot is free to send (a heap)
    sent = 0
    while sent < len(reqs) or any(s.sched.busy for s in sims):
        busy = [k for k, s in enumerate(sims) if s.sched.busy]
        k = min(busy, key=lambda k: sims[k].now) if busy else None
        if sent < len(reqs) and slots and (k is None or slots[0] <= sims[k].now):
            t = heapq.heappop(slots)
            r = router.pick(prompt_ids(reqs[sent]))
            times[sent], where[reqs[sent].id] = t, r
            if not sims[r].sched.busy:
                sims[r].now = max(sims[r].now, t)
            sims[r].add(sent)
            served[r] += 1
            sent += 1
            continue
        if k is None:
            raise RuntimeError("nothing runs and nothing can be sent")
        sim = sims[k]
        step = sim.decide()
        if not step.entries:
            raise RuntimeError(f"replica {k} scheduled nothing with requests waiting")
        sim.run_step(step)
        for rid, _ in sim.retired:
            router.finished(where[rid])
            heapq.heappush(slots, sim.now)
    res = SimResult(f"{replicas} replicas, {policy}", [], sum(s.res.slots for s in sims))
    for s in sims:
        res.records += _clean(s.records)
        res.steps += s.res.steps
        res.generated += s.res.generated
        res.preemptions += s.res.preemptions
    res.total = max(s.now for s in sims)
    hits = sum(s.sched.kv.prefix_hit_blocks for s in sims) * sims[0].sched.kv.block_size
    prompt = sum(len(prompt_ids(r)) for r in reqs)
    return res, {"served_per_replica": served, "hit_rate": hits / prompt if prompt else 0.0}


def scheduler_factory(config: dict, calibration: Optional[list] = None) -> Callable[[], Scheduler]:
    """A fresh replica's scheduler from simulate_continuous's arguments (replay.simulation_args), its pacer started
    from `calibration` (the steps a live replica's Warmup timed, its trace's first line) as the live one was."""
    def make() -> Scheduler:
        kv = KVManager(config["num_blocks"], config["block_size"], config.get("prefix_caching", True),
                       config.get("swap_blocks", 0))
        paced = pacer(config.get("prefill_step_ratio", 0.0))
        if paced is not None and calibration:
            paced.calibrate(calibration)
        return Scheduler(config["budget"], kv, config.get("policy", "fifo"), config.get("safety_margin", 0.0), paced)
    return make
