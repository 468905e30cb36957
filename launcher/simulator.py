"""The simulator: the production scheduler and block table (imported, not copied) driven by a simulated shard whose
step time comes from a cost model; and, to compare against, static batching in fixed padded groups.

The continuous loop mirrors router/engine.py: retire what finished in the previous step → add what has arrived →
schedule → one forward (time += cost of its entries) → one token for every entry that samples; a request whose
generated count reaches max_new_tokens (EOS ignored) is retired at the start of the next step. Arrivals come at
times (seconds, or steps under the unit cost model) or, to replay a live trace, just before a given schedule()
call. Results are per-request records in cb-bench's format, so both are summarized by the same code.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from launcher.bench_stats import summarize
from launcher.cost_model import CostModel
from router.block_table import BlockTable
from router.request import Request
from router.scheduler import Budget, Scheduler
from launcher.workloads import Req


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
        """Useful token-slots over all slots of all steps (seed 004's 'slot time doing real work')."""
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


def block_table(num_blocks: int, block_size: int, prefix_caching: bool) -> BlockTable:
    """The production block table; prefix caching as the server runs it (on by default there), where supported."""
    table = BlockTable(num_blocks, block_size)
    if hasattr(table, "prefix_caching"):
        table.prefix_caching = prefix_caching
    return table


def prompt_ids(req: Req) -> list[int]:
    """The request's ids when known; else ids unique to it, so no two simulated requests share a prefix block
    (a request still finds its own blocks again after a soft reset, as in the live router)."""
    if req.prompt_ids is not None:
        return list(req.prompt_ids)
    base = (req.id * 1_000_003) % (1 << 31)
    return [(base + k) % (1 << 31) for k in range(req.prompt_tokens)]


def _record(req: Req, arrival: float) -> dict:
    return {"id": req.id, "prompt_tokens": req.prompt_tokens, "max_new_tokens": req.max_new_tokens, "tokens": 0,
            "ttft": None, "itl": [], "e2e": None, "start": arrival, "wait": None, "error": None,
            "generated_tokens": None, "_last": None}


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


def simulate_continuous(reqs: list[Req], budget: Budget, num_blocks: int, block_size: int,
                        cost: Optional[CostModel] = None, times: Optional[list[float]] = None,
                        at_steps: Optional[list[int]] = None, record: bool = False,
                        prefix_caching: bool = True, policy: str = "fifo", safety_margin: float = 0.0,
                        swap_blocks: int = 0) -> SimResult:
    """Continuous batching through router.scheduler.Scheduler. `times`: arrival offsets (default all at 0);
    `at_steps`: instead, the index of the schedule() call each request arrives just before (trace replay).
    The simulator knows lengths, not texts: requests without ids never share prefix blocks with each other."""
    cost = cost or CostModel.steps()
    times = times or [0.0] * len(reqs)
    keys = at_steps if at_steps is not None else times
    pending = deque(sorted(range(len(reqs)), key=lambda i: (keys[i], i)))
    swap = BlockTable(swap_blocks, block_size) if swap_blocks else None
    sched = Scheduler(budget, block_table(num_blocks, block_size, prefix_caching), policy, safety_margin, swap)
    res = SimResult("continuous", [], budget.max_batch_size)
    records: dict[int, dict] = {}
    arrived_at: dict[int, float] = {}
    done: list[Request] = []
    retired: list[list[int]] = []  # [id, generated] retired since the last schedule() call, as the trace has them
    arrived: list[dict] = []       # requests added since the last schedule() call, as the trace has them
    now, calls, seq = 0.0, 0, 0

    def add(i: int) -> None:
        nonlocal seq
        r = reqs[i]
        arrived_at[r.id] = times[i] if at_steps is None else now
        records[r.id] = _record(r, arrived_at[r.id])
        sched.add(Request(prompt_ids=prompt_ids(r), max_new_tokens=r.max_new_tokens, id=r.id, arrival=float(seq)))
        arrived.append({"id": r.id, "prompt_tokens": r.prompt_tokens, "max_new_tokens": r.max_new_tokens,
                        "priority": 0})
        seq += 1

    def due(i: int) -> bool:
        return at_steps[i] <= calls if at_steps is not None else times[i] <= now

    def jump() -> None:
        """Nothing can run: move on to the next arrival (in replay mode, take it early)."""
        nonlocal now
        head = pending[0]
        if at_steps is None:
            now = max(now, times[head])
        else:
            while pending and at_steps[pending[0]] == at_steps[head]:
                add(pending.popleft())

    while True:
        for r in done:
            sched.finish(r)
            retired.append([r.id, len(r.generated)])
        done = []
        while pending and due(pending[0]):
            add(pending.popleft())
        if not (sched.running or sched.waiting or sched.offloaded):
            if not pending:
                break
            jump()
            continue
        step = sched.schedule()
        calls += 1
        res.peak_blocks = max(res.peak_blocks, sched.blocks.num_used)
        res.preemptions += len(step.preempted)
        res.offloads += len(step.offloaded)
        if record:  # the live trace's format (router/trace.py), so a simulated run can be replayed or calibrated on
            res.decisions.append({
                "step": calls - 1, "time": now, "arrivals": arrived, "finished": retired,
                "entries": [[e.request.id, e.start, e.num_tokens, e.sample] for e in step.entries],
                "preempted": [r.id for r in step.preempted], "offloaded": [r.id for r in step.offloaded],
                "restored": [r.id for r in step.restored]})
        retired, arrived = [], []
        for e in step.entries:
            rec = records[e.request.id]
            if rec["wait"] is None:
                rec["wait"] = now - arrived_at[e.request.id]
        if not step.entries:
            if not pending:
                raise RuntimeError("the scheduler scheduled nothing and nothing is left to arrive")
            jump()
            continue
        now += cost.step_time((e.start, e.num_tokens) for e in step.entries)
        res.steps += 1
        for e in step.entries:
            if e.sample:
                req = e.request
                req.generated.append(0)
                res.generated += 1
                _on_token(records[req.id], arrived_at[req.id], now)
                if req.is_done_generating:
                    done.append(req)
    res.total = now
    res.records = _clean(records)
    return res


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

