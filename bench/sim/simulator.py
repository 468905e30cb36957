"""The simulator: the production scheduler and KV manager (imported, not copied) driven by a simulated shard whose
step time comes from a cost model; and, to compare against, static batching in fixed padded groups.

The continuous loop drives the scheduler as the engine does: add what has arrived → schedule() → one forward
(time += cost of its entries) → update() with one token for every entry that samples, which retires the requests
that reached max_new_tokens (EOS never comes). Arrivals come at times (seconds, or steps under the unit cost
model) or, to replay a live trace, just before a given schedule() call. Results are per-request records in
cb-bench's format, so both are summarized by the same code.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from bench.sim.cost_model import CostModel
from bench.stats import new_record, summarize
from bench.workloads import Req
from router.core.kv import KVManager
from router.core.pacing import pacer
from router.core.request import Request
from router.core.scheduler import Budget, Scheduler
from router.core.step import Outcome, Step


@dataclass
class SimResult:
    policy: str
    records: list[dict]
    slots: int
    steps: int = 0                 # forward passes
    total: float = 0.0             # time of the last token (seconds, or steps under the unit cost)
    generated: int = 0
    peak_blocks: int = 0
    preemptions: int = 0           # soft resets
    offloads: int = 0
    decisions: list = field(default_factory=list)  # per schedule() call, when recorded

    @property
    def utilisation(self) -> float:
        """Useful token-slots over all slots of all steps (the share of slot time doing real work)."""
        return self.generated / (self.slots * self.steps) if self.steps else 0.0

    @property
    def mean_completion(self) -> float:
        return sum(r["e2e"] for r in self.records) / len(self.records) if self.records else 0.0

    @property
    def mean_wait(self) -> float:
        waits = [r["wait"] for r in self.records if r.get("wait") is not None]
        return sum(waits) / len(waits) if waits else 0.0

    def summary(self, percentiles=(50, 90, 99)) -> dict:
        s = summarize(self.records, self.total, percentiles)
        s.update(policy=self.policy, steps=self.steps, total=self.total, utilisation=self.utilisation,
                 mean_completion=self.mean_completion, mean_wait=self.mean_wait, peak_blocks=self.peak_blocks,
                 preemptions=self.preemptions, slots=self.slots)
        return s


def prompt_ids(req: Req) -> list[int]:
    """The request's ids when known; else ids unique to it, so no two simulated requests share a prefix block
    (a request still finds its own blocks again after a soft reset, as in the live router)."""
    if req.prompt_ids is not None:
        return list(req.prompt_ids)
    base = (req.id * 1_000_003) % (1 << 31)
    return [(base + k) % (1 << 31) for k in range(req.prompt_tokens)]


def _record(req: Req, arrival: float) -> dict:
    return new_record(req, arrival, wait=None, _last=None)


def _on_token(rec: dict, arrival: float, now: float) -> None:
    rec["tokens"] += 1
    if rec["_last"] is None:
        rec["ttft"] = now - arrival
    else:
        rec["itl"].append(now - rec["_last"])
    rec["_last"] = now
    rec["e2e"] = now - arrival


def _clean(records: dict) -> list[dict]:
    out = []
    for rec in records.values():
        rec.pop("_last", None)
        rec["generated_tokens"] = rec["tokens"]
        out.append(rec)
    return out


class _Continuous:
    """One simulated run: arrivals → schedule() → a forward costed by the model → update(), as the engine does."""

    def __init__(self, reqs: list[Req], sched: Scheduler, cost: CostModel, times: list[float],
                 at_steps: Optional[list[int]], record: bool, took: Optional[list[Optional[float]]] = None):
        """took: replaying a trace, its lines' measured times of the step before each (what the pacer saw)."""
        self.reqs, self.sched, self.cost, self.times, self.at_steps, self.record, self.took = \
            reqs, sched, cost, times, at_steps, record, took
        keys = at_steps if at_steps is not None else times
        self.pending = deque(sorted(range(len(reqs)), key=lambda i: (keys[i], i)))
        self.res = SimResult("continuous", [], sched.budget.max_batch_size)
        self.records: dict[int, dict] = {}
        self.arrived_at: dict[int, float] = {}
        self.retired: list[list[int]] = []  # [id, generated] since the last schedule() call, as the trace has them
        self.arrived: list[dict] = []       # requests added since the last schedule() call, as the trace has them
        self.now, self.calls = 0.0, 0
        self.last_took: Optional[float] = None  # the last step's time as the pacer saw it, for the next line

    def add(self, i: int) -> None:
        r = self.reqs[i]
        self.arrived_at[r.id] = self.times[i] if self.at_steps is None else self.now
        self.records[r.id] = _record(r, self.arrived_at[r.id])
        self.sched.add(Request(prompt_ids=prompt_ids(r), max_new_tokens=r.max_new_tokens, id=r.id,
                               arrival=float(len(self.records))))
        self.arrived.append({"id": r.id, "prompt_tokens": r.prompt_tokens, "max_new_tokens": r.max_new_tokens,
                             "priority": 0})

    def due(self, i: int) -> bool:
        return self.at_steps[i] <= self.calls if self.at_steps is not None else self.times[i] <= self.now

    def jump(self) -> None:
        """Nothing can run: move on to the next arrival (in replay mode, take it early)."""
        head = self.pending[0]
        if self.at_steps is None:
            self.now = max(self.now, self.times[head])
        else:
            while self.pending and self.at_steps[self.pending[0]] == self.at_steps[head]:
                self.add(self.pending.popleft())

    def decide(self) -> Step:
        step = self.sched.schedule()
        self.calls += 1
        self.res.peak_blocks = max(self.res.peak_blocks, self.sched.kv.pool.num_used)
        self.res.preemptions += len(step.preempted)
        self.res.offloads += len(step.offloaded)
        if self.record:  # the live trace's format (router/trace.py): a simulated run can be replayed or fitted
            self.res.decisions.append({
                "step": self.calls - 1, "time": self.now, "took": self.last_took, "arrivals": self.arrived,
                "finished": self.retired,
                "entries": [[e.request.id, e.start, e.num_tokens, e.sample] for e in step.entries],
                "preempted": [r.id for r in step.preempted], "offloaded": [r.id for r in step.offloaded],
                "restored": [r.id for r in step.restored]})
        self.retired, self.arrived, self.last_took = [], [], None
        for e in step.entries:
            rec = self.records[e.request.id]
            if rec["wait"] is None:
                rec["wait"] = self.now - self.arrived_at[e.request.id]
        return step

    def run_step(self, step: Step) -> None:
        """The simulated shard: the step costs what the model says and samples token 0 (never a stop token)."""
        seconds = self.cost.step_time((e.start, e.num_tokens) for e in step.entries)
        self.now += seconds
        if self.took is not None:  # the pacer learns what the live one learned
            seconds = (self.took[self.calls] if self.calls < len(self.took) else None) or 0.0
        self.last_took = seconds
        self.res.steps += 1
        sampled = [e.request for e in step.entries if e.sample]
        finished = self.sched.update(step, Outcome(tokens={r.id: 0 for r in sampled}, seconds=seconds))
        for r in sampled:
            self.res.generated += 1
            _on_token(self.records[r.id], self.arrived_at[r.id], self.now)
        self.retired += [[r.id, len(r.generated)] for r in finished]

    def run(self) -> SimResult:
        while True:
            while self.pending and self.due(self.pending[0]):
                self.add(self.pending.popleft())
            if not self.sched.busy:
                if not self.pending:
                    break
                self.jump()
                continue
            step = self.decide()
            if not step.entries:
                if not self.pending:
                    raise RuntimeError("the scheduler scheduled nothing and nothing is left to arrive")
                self.jump()
                continue
            self.run_step(step)
        self.res.total = self.now
        self.res.records = _clean(self.records)
        return self.res


def simulate_continuous(reqs: list[Req], budget: Budget, num_blocks: int, block_size: int,
                        cost: Optional[CostModel] = None, times: Optional[list[float]] = None,
                        at_steps: Optional[list[int]] = None, record: bool = False,
                        prefix_caching: bool = True, policy: str = "fifo", safety_margin: float = 0.0,
                        swap_blocks: int = 0, prefill_step_ratio: float = 0.0,
                        took: Optional[list[Optional[float]]] = None,
                        calibration: Optional[list] = None) -> SimResult:
    """Continuous batching through the production Scheduler and KVManager. `times`: arrival offsets (default all
    at 0); `at_steps`: instead, the index of the schedule() call each request arrives just before (trace replay).
    The simulator knows lengths, not texts: requests without ids never share prefix blocks with each other.
    prefill_step_ratio: the router's pacer (router/core/pacing.py), learning the cost model's step times, or with
    `took` (a replay) the live ones, starting from `calibration` (the steps the live router's Warmup timed)."""
    kv = KVManager(num_blocks, block_size, prefix_caching, swap_blocks)
    paced = pacer(prefill_step_ratio)
    if paced is not None and calibration:
        paced.calibrate(calibration)
    sched = Scheduler(budget, kv, policy, safety_margin, paced)
    return _Continuous(reqs, sched, cost or CostModel.steps(), times or [0.0] * len(reqs), at_steps, record,
                       took).run()


def simulate_static(reqs: list[Req], batch_size: int, cost: Optional[CostModel] = None,
                    times: Optional[list[float]] = None) -> SimResult:
    """Static batching: when idle, take up to batch_size of the requests that have arrived, pad their prompts to the
    longest and run the group until its longest member is done; the group returns together (e2e = group end)."""
    cost = cost or CostModel.steps()
    times = times or [0.0] * len(reqs)
    pending = deque(sorted(range(len(reqs)), key=lambda i: (times[i], i)))
    res = SimResult("static", [], batch_size)
    records: dict[int, dict] = {}
    now = 0.0
    while pending:
        now = max(now, times[pending[0]])
        group = []
        while pending and len(group) < batch_size and times[pending[0]] <= now:
            group.append(pending.popleft())
        b = len(group)
        p = max(reqs[i].prompt_tokens for i in group)
        m = max(reqs[i].max_new_tokens for i in group)
        for i in group:
            records[reqs[i].id] = _record(reqs[i], times[i])
            records[reqs[i].id]["wait"] = now - times[i]
        for k in range(m):
            entries = [(0, p)] * b if k == 0 else [(p + k - 1, 1)] * b
            now += cost.step_time(entries)
            res.steps += 1
            for i in group:
                if k < reqs[i].max_new_tokens:
                    _on_token(records[reqs[i].id], times[i], now)
                    res.generated += 1
        for i in group:
            records[reqs[i].id]["e2e"] = now - times[i]
    res.total = now
    res.records = _clean(records)
    return res

