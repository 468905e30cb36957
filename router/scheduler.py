"""Decides, every step, which tokens of which requests run: TGI's budgeted loop, at token granularity.

Order of a step: every running decode gets one token (and a block when its last one is full); running
prompts that were chunked continue; then waiting requests are admitted in arrival order while the prefill
budget, the total-token budget, the KV blocks and max_batch_size allow. A prompt larger than the prefill
budget left is chunked. With requests already running, new ones are admitted only when at least
waiting_served_ratio waiting requests per running one are queued, or max_waiting_tokens steps have passed
since the last admission (TGI's documented meaning; the count is of the queue, not of what fits this step,
so a small prefill budget admitting a few requests per step never stalls a long queue). When a running request
cannot get its next block, the newest running request that is not scheduled yet is preempted: its blocks
are freed and it goes back to the head of the queue with its generated tokens as part of its prompt. A step
that had to preempt admits nobody (the victim would come straight back and be preempted again).

Pure Python: no torch, no grpc.
"""
from collections import deque
from dataclasses import dataclass, field

from router.block_table import BlockTable, chain_hash
from router.request import Request, State


@dataclass(frozen=True)
class Budget:
    max_batch_prefill_tokens: int
    max_batch_total_tokens: int
    max_batch_size: int
    waiting_served_ratio: float = 0.3
    max_waiting_tokens: int = 20


@dataclass
class Entry:
    """One request's share of a step: tokens[start:start + num_tokens], blocks appended first."""
    request: Request
    start: int
    num_tokens: int
    new_blocks: list[int]
    sample: bool
    first: bool
    decode: bool


@dataclass
class Step:
    entries: list[Entry] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def prefill_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries if not e.decode)

    @property
    def has_prefill(self) -> bool:
        return any(not e.decode for e in self.entries)


class Scheduler:
    def __init__(self, budget: Budget, blocks: BlockTable):
        self.budget = budget
        self.blocks = blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.steps_since_admission = 0
        self.prefix_lookups = 0
        self.prefix_hit_blocks = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def held_tokens(self) -> int:
        return sum(r.computed for r in self.running)

    def schedule(self) -> Step:
        step = Step()
        held = self.held_tokens
        scheduled: set[int] = set()
        for req in list(self.running):
            if req.state is not State.RUNNING or not req.is_decoding or req.id in scheduled:
                continue
            room = self._make_room(req, held, scheduled, step)
            if room is None:
                continue
            held = room + 1
            self._schedule(step, req, 1, scheduled)
        prefill_left = self.budget.max_batch_prefill_tokens
        for req in list(self.running):
            if req.state is not State.RUNNING or req.is_decoding or req.id in scheduled:
                continue
            n = self._fit(req, prefill_left, self.budget.max_batch_total_tokens - held)
            if n == 0:
                continue
            self._schedule(step, req, n, scheduled)
            prefill_left -= n
            held += n
        admitted = 0 if step.preempted else self._admit(step, scheduled, prefill_left, held)
        self.steps_since_admission = 0 if admitted else self.steps_since_admission + 1
        return step

    def _admit(self, step: Step, scheduled: set[int], prefill_left: int, held: int) -> int:
        """Plans admissions without touching anything, then commits them only if they are worth it."""
        plan: list[tuple[Request, int, list[int], list[bytes]]] = []
        free = self.blocks.num_free
        slots = self.budget.max_batch_size - len(self.running)
        bs = self.blocks.block_size
        for req in self.waiting:
            if slots <= 0 or prefill_left <= 0:
                break
            hits, names = [], []
            if req.reuse_prefix:
                hits, names = self.blocks.lookup(req.tokens[:req.num_tokens - 1])  # the last token is computed
            cached = len(hits) * bs
            n = min(req.num_tokens - cached, prefill_left, self.budget.max_batch_total_tokens - held - cached)
            n = min(n, (free - self.blocks.free_among(hits)) * bs)
            if n <= 0:
                break
            plan.append((req, n, hits, names))
            free -= self.blocks.extra_blocks(len(hits), cached + n) + self.blocks.free_among(hits)
            prefill_left -= n
            held += cached + n
            slots -= 1
            if cached + n < req.num_tokens:
                break
        if self.running and self.steps_since_admission < self.budget.max_waiting_tokens:
            if len(self.waiting) < int(len(self.running) * self.budget.waiting_served_ratio):
                return 0
        for req, n, hits, names in plan:
            self.waiting.remove(req)
            req.state = State.RUNNING
            self.running.append(req)
            if req.reuse_prefix:
                self.prefix_lookups += 1
                self.prefix_hit_blocks += len(hits)
            self.blocks.share(hits)
            req.blocks, req.hashes, req.computed = list(hits), list(names), len(hits) * bs
            self._schedule(step, req, n, scheduled)
        return len(plan)

    def _fit(self, req: Request, prefill_left: int, total_left: int) -> int:
        n = min(req.remaining, prefill_left, total_left)
        free_tokens = self.blocks.num_free * self.blocks.block_size
        room_in_last = len(req.blocks) * self.blocks.block_size - req.computed
        return max(0, min(n, free_tokens + room_in_last))

    def _schedule(self, step: Step, req: Request, n: int, scheduled: set[int]) -> None:
        extra = self.blocks.extra_blocks(len(req.blocks), req.computed + n)
        new_blocks = self.blocks.allocate(extra)
        req.blocks.extend(new_blocks)
        first = not req.on_shards
        sample = req.computed + n == req.num_tokens
        sent_blocks = list(req.blocks) if first else new_blocks  # a first step carries its shared prefix too
        step.entries.append(Entry(req, req.computed, n, sent_blocks, sample, first, req.is_decoding))
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

    def _make_room(self, req: Request, held: int, scheduled: set[int], step: Step):
        """Preempts the newest unscheduled running requests until `req` can grow by one token within both
        the block pool and the total-token budget; returns the tokens then held, or None if it cannot."""
        while (self.blocks.extra_blocks(len(req.blocks), req.computed + 1) > self.blocks.num_free
               or held + 1 > self.budget.max_batch_total_tokens):
            victims = [r for r in self.running if r.id not in scheduled and r is not req]
            if not victims:
                return None
            victim = max(victims, key=lambda r: r.arrival)
            held -= victim.computed
            self.preempt(victim, step)
        return held

    def preempt(self, req: Request, step: Step) -> None:
        """Soft reset: free the blocks, keep the tokens, requeue at the head of the queue."""
        self.running.remove(req)
        self.blocks.free(req.blocks)
        req.blocks, req.hashes = [], []
        req.computed = 0
        req.on_shards = False
        req.preemptions += 1
        req.state = State.WAITING
        self.waiting.appendleft(req)
        step.preempted.append(req)

    def finish(self, req: Request) -> None:
        """Retires a request (finished or cancelled) and returns its blocks to the pool."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.blocks.free(req.blocks)
        req.blocks = []
        req.state = State.FINISHED
