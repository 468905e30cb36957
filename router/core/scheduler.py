"""Decides, every step, which tokens of which requests run: TGI's budgeted loop, at token granularity.

A step serves, in this order:
1. Running requests. `fifo`: every decode gets one token (and a block when its last one is full), then prompts
   that were chunked continue. `prefill_first`: chunked prompts continue first (they take the free blocks
   before decodes do), then decodes. Within each group: priority, then arrival.
2. Offloaded requests come back (restore), best rank first, when their blocks and one more step fit.
3. Waiting requests are admitted by rank (priority, lower first, then arrival) while the prefill budget, the
   total-token budget, max_batch_size and every allocator (the pool and, on hybrid models, the window pool)
   allow; a prompt larger than what is left is chunked. Nothing is allocated unless the whole plan fits.
   Admission stops at the first request ranked below an offloaded one (that one is restored first); it pauses
   in a step that evicted (the victim would come straight back) and while free blocks are below the safety
   margin of the pool (running requests keep the rest; ignored when nothing runs); with requests running it
   waits until waiting_served_ratio waiting requests per running one are queued or max_waiting_tokens steps
   have passed since the last admission (TGI's rule).
While requests decode, the prompt tokens of a step (chunks, restores and admissions together) are also bounded
by the pacer (pacing.py), so the decodes' step stays within a multiple of its time without them (a multiple that
grows with the requests queued per decoding one).

Eviction: when a running decode cannot get its next block, the worst-ranked running request not yet scheduled
this step (lowest priority, newest) is evicted, repeatedly, until it fits; only requests ranked below the
decode are candidates (otherwise it waits), and requests already scheduled keep their cache, so the last running
request is never evicted. An evicted request is offloaded when the swap pool has room (its blocks are copied
to host memory and restored later without recomputation) and soft-reset otherwise (blocks freed, its generated
tokens join its prompt, it waits by rank).
If nothing at all could be scheduled, the worst-ranked running request is evicted and the step planned again.

After the step ran, `update` applies its outcome: the one place where a sampled token joins its request and the
request finishes (a stop token, max_new_tokens) and leaves, and the pacer learns how long
the step took. With speculation (speculation.py) a decode may carry drafts after its token: the drafts it
accepted join it too, and its cache is taken back past the rest. The engine, the simulator and the
tests all drive the scheduler through schedule() and update(). Every block decision goes through the KV
manager (kv.py). Pure Python: no torch, no grpc, no asyncio.
"""
import bisect
from dataclasses import dataclass
from typing import Optional

from router.core.kv import KVManager
from router.core.pacing import Pacer
from router.core.request import Request, State
from router.core.speculation import Speculator
from router.core.step import Entry, Outcome, Step

# The policies, each with its default safety margin (transformers' continuous batching uses the same values).
POLICIES = {"fifo": 0.15, "prefill_first": 0.0}


@dataclass(frozen=True)
class Budget:
    max_batch_prefill_tokens: int
    max_batch_total_tokens: int
    max_batch_size: int
    waiting_served_ratio: float
    max_waiting_tokens: int


def _rank(r: Request) -> tuple:
    return r.rank


class Scheduler:
    def __init__(self, budget: Budget, kv: KVManager, policy: str = "fifo", safety_margin: float = 0.0,
                 pacer: Optional[Pacer] = None, speculator: Optional[Speculator] = None):
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduler policy {policy!r}: choose one of {', '.join(POLICIES)}")
        self.budget = budget
        self.kv = kv
        self.policy = policy
        self.safety_margin = safety_margin
        self.pacer = pacer
        self.speculator = speculator if kv.window is None else None  # a window table cannot take drafts back
        self.waiting: list[Request] = []    # by rank
        self.offloaded: list[Request] = []  # by rank
        self.running: list[Request] = []
        self.steps_since_admission = 0

    def add(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=_rank)

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting or self.offloaded)

    @property
    def held_tokens(self) -> int:
        return sum(r.computed for r in self.running)

    def schedule(self) -> Step:
        step = Step()
        while True:
            self._plan(step)
            if step.entries or len(self.running) < 2:
                return step
            self._evict(max(self.running, key=_rank), step)  # deadlock: nothing fit, make room and retry

    def update(self, step: Step, outcome: Outcome) -> list[Request]:
        """Applies a step's outcome: each sampled token joins its request, which finishes on a stop token or at
        max_new_tokens, in that order of precedence. Returns the requests that finished; they have already left
        and freed their blocks."""
        if self.pacer is not None and outcome.seconds:
            self.pacer.observe(step.decodes, step.chunks, outcome.seconds)
        finished = []
        for e in step.entries:
            req = e.request
            token = outcome.tokens.get(req.id)
            if not e.sample or token is None or req.state is not State.RUNNING:
                continue
            produced = [token] + outcome.more.get(req.id, [])[:len(e.drafts)]
            for token in produced:
                req.generated.append(token)
                if token in req.stop_ids:
                    self.finish(req, "eos_token")
                elif req.is_done_generating:
                    self.finish(req, "length")
                else:
                    continue
                break
            if e.drafts:
                self.speculator.observe(req, len(e.drafts), len(produced) - 1)
            if req.state is State.FINISHED:
                finished.append(req)
            elif e.drafts:
                req.computed = req.num_tokens - 1  # the accepted drafts' KV stays; the rest is overwritten later
        return finished

    def finish(self, req: Request, reason: Optional[str] = None) -> None:
        """Retires a request (finished, or cancelled when no reason is given) and frees all it holds."""
        for queue in (self.running, self.waiting, self.offloaded):
            if req in queue:
                queue.remove(req)
        self.kv.release(req)
        req.state = State.FINISHED
        req.finish_reason = reason
        if self.speculator is not None:
            self.speculator.forget(req)

    def _plan(self, step: Step) -> None:
        held = self.held_tokens
        scheduled: set[int] = set()
        running = sorted(self.running, key=_rank)
        decodes = [r for r in running if r.is_decoding]
        chunks = [r for r in running if not r.is_decoding]
        prefill_left = self.prompt_budget(len(decodes), chunks[0].computed if chunks else 0, len(self.waiting))
        for group in (decodes, chunks) if self.policy == "fifo" else (chunks, decodes):
            for req in group:
                if req.state is not State.RUNNING or req.id in scheduled:
                    continue  # evicted earlier in this step
                if req.is_decoding:
                    room = self._make_room(req, held, scheduled, step)
                    if room is not None:
                        drafts = self._drafts(req, len(decodes), room + 1)
                        held = room + 1 + len(drafts)
                        self._schedule(step, req, 1 + len(drafts), scheduled, drafts)
                    continue
                n = max(0, min(req.remaining, prefill_left, self.budget.max_batch_total_tokens - held,
                               self.kv.room(req)))
                if n:
                    self._schedule(step, req, n, scheduled)
                    prefill_left -= n
                    held += n
        admitted = 0
        if not step.evicted:
            prefill_left, held = self._restore(step, scheduled, prefill_left, held)
            admitted = self._admit(step, scheduled, prefill_left, held)
        self.steps_since_admission = 0 if admitted else self.steps_since_admission + 1

    def prompt_budget(self, decodes: int, start: int, queued: int) -> int:
        """Prompt tokens a step beside `decodes` decodes may compute, its first chunk after `start` cached tokens,
        `queued` requests waiting for admission: the budget, or less as the pacer says."""
        budget = self.budget.max_batch_prefill_tokens
        paced = self.pacer.prompt_tokens(decodes, start, queued) if self.pacer is not None else None
        return budget if paced is None else min(paced, budget)

    def _restore(self, step: Step, scheduled: set[int], prefill_left: int, held: int) -> tuple[int, int]:
        """Brings offloaded requests back, best rank first, while their blocks and their next step fit."""
        for req in list(self.offloaded):
            n = 1 if req.remaining == 1 else min(req.remaining, prefill_left)
            if (n == 0 or not self.kv.can_restore(req, n) or len(self.running) >= self.budget.max_batch_size
                    or held + req.computed + n > self.budget.max_batch_total_tokens):
                break
            step.to_device.extend(self.kv.restore(req))
            step.tables[req.id] = list(req.blocks)
            self.offloaded.remove(req)
            req.state = State.RUNNING
            self.running.append(req)
            step.restored.append(req)
            held += req.computed + n
            if req.remaining > 1:  # a prompt chunk, however short
                prefill_left -= n
            self._schedule(step, req, n, scheduled)
        return prefill_left, held

    def _admit(self, step: Step, scheduled: set[int], prefill_left: int, held: int) -> int:
        """Plans admissions without touching anything, then commits them only if they are worth it."""
        plan = []
        free = self.kv.free()
        slots = self.budget.max_batch_size - len(self.running)
        reserve = self.safety_margin * self.kv.pool.num_blocks
        for req in self.waiting:
            if slots <= 0 or prefill_left <= 0 or ((self.running or plan) and free.pool < reserve):
                break
            if req.gated:
                continue
            if self.offloaded and req.rank > self.offloaded[0].rank:
                break  # an offloaded request that outranks it comes back first
            hit = self.kv.lookup(req)
            cached = len(hit.blocks) * self.kv.block_size
            n = min(req.num_tokens - cached, prefill_left, self.budget.max_batch_total_tokens - held - cached,
                    self.kv.admission_room(req, hit, free))
            if n <= 0:
                break
            plan.append((req, n, hit))
            self.kv.take(free, req, hit, n)
            prefill_left -= n
            held += cached + n
            slots -= 1
            if cached + n < req.num_tokens:
                break
        if self.running and self.steps_since_admission < self.budget.max_waiting_tokens:
            if len(self.waiting) < int(len(self.running) * self.budget.waiting_served_ratio):
                return 0
        for req, n, hit in plan:  # every hit is taken before any allocation could evict it
            self.kv.share(req, hit)
        for req, n, hit in plan:
            self.waiting.remove(req)
            req.state = State.RUNNING
            self.running.append(req)
            self._schedule(step, req, n, scheduled)
        return len(plan)

    def _drafts(self, req: Request, decodes: int, held: int) -> list[int]:
        """Speculation's proposals for a decode: within the blocks it holds and the free blocks beyond one for
        each running request (drafts never make a decode evict), the token budget and max_new_tokens."""
        if self.speculator is None or not req.speculate:
            return []
        bs = self.kv.block_size
        spare = max(0, self.kv.pool.num_free - len(self.running)) * bs
        room = min(len(req.blocks) * bs - req.computed - 1 + spare, self.budget.max_batch_total_tokens - held,
                   req.max_new_tokens - len(req.generated) - 1)
        return self.speculator.propose(req, decodes, room)

    def _schedule(self, step: Step, req: Request, n: int, scheduled: set[int], drafts: list[int] = ()) -> None:
        first = not req.on_shards
        growth = self.kv.grow(req, n)
        window_blocks = list(req.window_blocks) if first else growth.new_window_blocks  # a first step: all of it
        sent_blocks = list(req.blocks) if first else growth.new_blocks  # a first step carries its shared prefix
        sample = req.computed + n - len(drafts) == req.num_tokens
        step.entries.append(Entry(req, req.computed, n, sent_blocks, sample, first, req.is_decoding, window_blocks,
                                  growth.window_dropped, list(drafts)))
        req.computed += n
        req.on_shards = True
        scheduled.add(req.id)

    def _make_room(self, req: Request, held: int, scheduled: set[int], step: Step) -> Optional[int]:
        """Evicts the worst-ranked unscheduled running requests ranked below `req` until it can grow by one
        token; returns the tokens then held, or None if it cannot (it waits, and is the next victim itself)."""
        while not self.kv.can_grow(req) or held + 1 > self.budget.max_batch_total_tokens:
            victims = [r for r in self.running if r.id not in scheduled and r.rank > req.rank]
            if not victims:
                return None
            victim = max(victims, key=_rank)
            held -= victim.computed
            self._evict(victim, step)
        return held

    def _evict(self, req: Request, step: Step) -> None:
        if self.kv.can_offload(req):
            self.offload(req, step)
        else:
            self.preempt(req, step)

    def offload(self, req: Request, step: Step) -> None:
        """Its blocks go to swap slots (copied before the step runs) and back to the pool; it keeps the rest."""
        self.running.remove(req)
        step.to_cpu.extend(self.kv.offload(req))
        step.tables[req.id] = []
        req.offloads += 1
        req.state = State.OFFLOADED
        bisect.insort(self.offloaded, req, key=_rank)
        step.offloaded.append(req)

    def preempt(self, req: Request, step: Step) -> None:
        """Soft reset: free the blocks, keep the tokens, wait again by rank (ahead of later arrivals)."""
        self._soft_reset(req)
        step.preempted.append(req)

    def reset_all(self) -> list[Request]:
        """The shards lost every cache (a new shard set): each request that held cache state waits again with
        its tokens, to resume from its history. Returns them."""
        held = self.running + self.offloaded
        for req in held:
            self._soft_reset(req)
        self.kv.forget()
        return held

    def _soft_reset(self, req: Request) -> None:
        (self.running if req in self.running else self.offloaded).remove(req)
        self.kv.release(req)
        req.hashes = []
        req.computed = 0
        req.on_shards = False
        req.preemptions += 1
        req.state = State.WAITING
        bisect.insort(self.waiting, req, key=_rank)
