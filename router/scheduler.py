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

Eviction: when a running decode cannot get its next block, the worst-ranked running request not yet scheduled
this step (lowest priority, newest) is evicted, repeatedly, until it fits; only requests ranked below the
decode are candidates (otherwise it waits), and requests already scheduled keep their cache, so the last running
request is never evicted. An evicted request is offloaded when the swap pool has room (its blocks are copied
to host memory and restored later without recomputation) and soft-reset otherwise (blocks freed, its generated
tokens join its prompt, it waits by rank).
If nothing at all could be scheduled, the worst-ranked running request is evicted and the step planned again.

Pure Python: no torch, no grpc.
"""
import bisect
from dataclasses import dataclass
from typing import Optional

from router.block_table import BlockTable, chain_hash
from router.request import Request, State
from router.step import Entry, Step
from router.window import WindowTable

POLICIES = ("fifo", "prefill_first")
DEFAULT_SAFETY_MARGIN = {"fifo": 0.15, "prefill_first": 0.0}


@dataclass(frozen=True)
class Budget:
    max_batch_prefill_tokens: int
    max_batch_total_tokens: int
    max_batch_size: int
    waiting_served_ratio: float = 0.3
    max_waiting_tokens: int = 20


def _rank(r: Request) -> tuple:
    return r.rank


class Scheduler:
    def __init__(self, budget: Budget, blocks: BlockTable, policy: str = "fifo", safety_margin: float = 0.0,
                 swap: Optional[BlockTable] = None, window: Optional[WindowTable] = None):
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduler policy {policy!r}: choose one of {', '.join(POLICIES)}")
        self.budget = budget
        self.blocks = blocks
        self.policy = policy
        self.safety_margin = safety_margin
        self.swap = swap
        self.window = window
        self.waiting: list[Request] = []    # by rank
        self.offloaded: list[Request] = []  # by rank
        self.running: list[Request] = []
        self.steps_since_admission = 0
        self.prefix_lookups = 0
        self.prefix_hit_blocks = 0

    def add(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=_rank)

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

    def _plan(self, step: Step) -> None:
        held = self.held_tokens
        scheduled: set[int] = set()
        prefill_left = self.budget.max_batch_prefill_tokens
        running = sorted(self.running, key=_rank)
        decodes = [r for r in running if r.is_decoding]
        chunks = [r for r in running if not r.is_decoding]
        for group in (decodes, chunks) if self.policy == "fifo" else (chunks, decodes):
            for req in group:
                if req.state is not State.RUNNING or req.id in scheduled:
                    continue  # evicted earlier in this step
                if req.is_decoding:
                    room = self._make_room(req, held, scheduled, step)
                    if room is not None:
                        held = room + 1
                        self._schedule(step, req, 1, scheduled)
                    continue
                n = self._fit(req, prefill_left, self.budget.max_batch_total_tokens - held)
                if n:
                    self._schedule(step, req, n, scheduled)
                    prefill_left -= n
                    held += n
        admitted = 0
        if not step.evicted:
            prefill_left, held = self._restore(step, scheduled, prefill_left, held)
            admitted = self._admit(step, scheduled, prefill_left, held)
        self.steps_since_admission = 0 if admitted else self.steps_since_admission + 1

    def _window_room(self, req: Request, start: int, wfree: Optional[int]) -> int:
        """Tokens from `start` the window pool can take (unbounded without one)."""
        if self.window is None:
            return 1 << 62
        drop, _ = self.window.plan(req, start, 1)
        return max(0, (req.window_base + len(req.window_blocks) + drop + wfree) * self.blocks.block_size - start)

    def _fit(self, req: Request, prefill_left: int, total_left: int) -> int:
        room = (len(req.blocks) + self.blocks.num_free) * self.blocks.block_size - req.computed
        wfree = self.window.blocks.num_free if self.window is not None else None
        return max(0, min(req.remaining, prefill_left, total_left, room, self._window_room(req, req.computed, wfree)))

    def _restore(self, step: Step, scheduled: set[int], prefill_left: int, held: int) -> tuple[int, int]:
        """Brings offloaded requests back, best rank first, while their blocks and their next step fit."""
        for req in list(self.offloaded):
            n = 1 if req.remaining == 1 else min(req.remaining, prefill_left)
            need = len(req.swap_slots) + self.blocks.extra_blocks(len(req.swap_slots), req.computed + n)
            if (n == 0 or need > self.blocks.num_free or len(self.running) >= self.budget.max_batch_size
                    or held + req.computed + n > self.budget.max_batch_total_tokens):
                break
            req.blocks = self.blocks.allocate(len(req.swap_slots))
            step.to_device.extend(zip(req.swap_slots, req.blocks))
            step.tables[req.id] = list(req.blocks)
            self.swap.free(req.swap_slots)
            req.swap_slots = []
            for block, name in zip(req.blocks, req.hashes):
                self.blocks.name(block, name)
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
        plan: list[tuple[Request, int, list[int], list[bytes]]] = []
        free = self.blocks.num_free
        wfree = self.window.blocks.num_free if self.window is not None else None
        slots = self.budget.max_batch_size - len(self.running)
        bs = self.blocks.block_size
        reserve = self.safety_margin * self.blocks.num_blocks
        for req in self.waiting:
            if slots <= 0 or prefill_left <= 0 or ((self.running or plan) and free < reserve):
                break
            if self.offloaded and req.rank > self.offloaded[0].rank:
                break  # an offloaded request that outranks it comes back first
            hits, names = [], []
            if req.reuse_prefix:
                hits, names = self.blocks.lookup(req.tokens[:req.num_tokens - 1])  # the last token is computed
            cached = len(hits) * bs
            n = min(req.num_tokens - cached, prefill_left, self.budget.max_batch_total_tokens - held - cached)
            n = min(n, (free - self.blocks.free_among(hits)) * bs, self._window_room(req, cached, wfree))
            if n <= 0:
                break
            plan.append((req, n, hits, names))
            free -= self.blocks.extra_blocks(len(hits), cached + n) + self.blocks.free_among(hits)
            if wfree is not None:
                wfree -= self.window.extra(req, cached, n)
            prefill_left -= n
            held += cached + n
            slots -= 1
            if cached + n < req.num_tokens:
                break
        if self.running and self.steps_since_admission < self.budget.max_waiting_tokens:
            if len(self.waiting) < int(len(self.running) * self.budget.waiting_served_ratio):
                return 0
        for req, n, hits, names in plan:  # every hit is taken before any allocation could evict it
            self.blocks.share(hits)
            req.blocks, req.hashes, req.computed = list(hits), list(names), len(hits) * bs
        for req, n, hits, names in plan:
            self.waiting.remove(req)
            req.state = State.RUNNING
            self.running.append(req)
            if req.reuse_prefix:
                self.prefix_lookups += 1
                self.prefix_hit_blocks += len(hits)
            self._schedule(step, req, n, scheduled)
        return len(plan)

    def _schedule(self, step: Step, req: Request, n: int, scheduled: set[int]) -> None:
        extra = self.blocks.extra_blocks(len(req.blocks), req.computed + n)
        new_blocks = self.blocks.allocate(extra)
        req.blocks.extend(new_blocks)
        first = not req.on_shards
        dropped, window_blocks = 0, []
        if self.window is not None:
            dropped, window_blocks = self.window.advance(req, req.computed, n)
            if first:  # the shard starts the table from scratch (dropped counts blocks it never had)
                window_blocks = list(req.window_blocks)
        sample = req.computed + n == req.num_tokens
        sent_blocks = list(req.blocks) if first else new_blocks  # a first step carries its shared prefix too
        step.entries.append(Entry(req, req.computed, n, sent_blocks, sample, first, req.is_decoding,
                                  window_blocks, dropped))
        req.computed += n
        req.on_shards = True
        scheduled.add(req.id)
        self._name_blocks(req)

    def _name_blocks(self, req: Request) -> None:
        """Names the request's newly full blocks (their bytes are written during this very step, before any
        later step can read them)."""
        bs = self.blocks.block_size
        while len(req.hashes) < min(req.computed // bs, len(req.blocks)):
            i = len(req.hashes)
            name = chain_hash(req.hashes[-1] if req.hashes else None, req.tokens[i * bs:(i + 1) * bs])
            self.blocks.name(req.blocks[i], name)
            req.hashes.append(name)

    def _short(self, req: Request, held: int) -> bool:
        """Whether `req` cannot grow by one token right now."""
        if self.blocks.extra_blocks(len(req.blocks), req.computed + 1) > self.blocks.num_free:
            return True
        if self.window is not None and self.window.extra(req, req.computed, 1) > self.window.blocks.num_free:
            return True
        return held + 1 > self.budget.max_batch_total_tokens

    def _make_room(self, req: Request, held: int, scheduled: set[int], step: Step) -> Optional[int]:
        """Evicts the worst-ranked unscheduled running requests ranked below `req` until it can grow by one
        token; returns the tokens then held, or None if it cannot (it waits, and is the next victim itself)."""
        while self._short(req, held):
            victims = [r for r in self.running if r.id not in scheduled and r.rank > req.rank]
            if not victims:
                return None
            victim = max(victims, key=_rank)
            held -= victim.computed
            self._evict(victim, step)
        return held

    def _evict(self, req: Request, step: Step) -> None:
        if self.swap is not None and self.window is None and len(req.blocks) <= self.swap.num_free:
            self.offload(req, step)
        else:
            self.preempt(req, step)

    def offload(self, req: Request, step: Step) -> None:
        """Its blocks go to swap slots (copied before the step runs) and back to the pool; it keeps the rest."""
        self.running.remove(req)
        req.swap_slots = self.swap.allocate(len(req.blocks))
        step.to_cpu.extend(zip(req.blocks, req.swap_slots))
        step.tables[req.id] = []
        self.blocks.free(req.blocks)
        req.blocks = []
        req.offloads += 1
        req.state = State.OFFLOADED
        bisect.insort(self.offloaded, req, key=_rank)
        step.offloaded.append(req)

    def preempt(self, req: Request, step: Step) -> None:
        """Soft reset: free the blocks, keep the tokens, wait again by rank (ahead of later arrivals)."""
        self.running.remove(req)
        self._release(req)
        req.hashes = []
        req.computed = 0
        req.on_shards = False
        req.preemptions += 1
        req.state = State.WAITING
        bisect.insort(self.waiting, req, key=_rank)
        step.preempted.append(req)

    def _release(self, req: Request) -> None:
        self.blocks.free(req.blocks)
        req.blocks = []
        if self.swap is not None:
            self.swap.free(req.swap_slots)
        req.swap_slots = []
        if self.window is not None:
            self.window.release(req)

    def finish(self, req: Request) -> None:
        """Retires a request (finished or cancelled) and returns its blocks and swap slots."""
        for queue in (self.running, self.waiting, self.offloaded):
            if req in queue:
                queue.remove(req)
        self._release(req)
        req.state = State.FINISHED
