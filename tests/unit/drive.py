"""Driving the pure scheduler as the engine does: schedule(), check every invariant, then update() with one
token per sampled entry (never a stop token, so requests finish at max_new_tokens). No other drive loop."""
import itertools
from collections import Counter

from router.core.request import Request, State
from router.core.scheduler import Scheduler
from router.core.step import Outcome, Step

_arrival = itertools.count()


def req(prompt_len: int, max_new: int) -> Request:
    return Request(prompt_ids=list(range(prompt_len)), max_new_tokens=max_new, arrival=next(_arrival))


def check(s: Scheduler, step: Step) -> None:
    """Every invariant that must hold right after schedule()."""
    b, pool = s.budget, s.kv.pool
    assert step.prefill_tokens <= b.max_batch_prefill_tokens
    assert len(s.running) <= b.max_batch_size
    assert s.held_tokens <= b.max_batch_total_tokens, "tokens held exceed max_batch_total_tokens"
    ids = [e.request.id for e in step.entries]
    assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
    for e in step.entries:
        r = e.request
        assert r in s.running and r.state is State.RUNNING
        assert e.num_tokens > 0 and e.start + e.num_tokens == r.computed
        assert e.sample == (r.computed - len(e.drafts) == r.num_tokens)  # drafts: proposed, not yet known
        assert set(e.new_blocks) <= set(r.blocks)
    for r in s.running:
        assert len(r.blocks) * pool.block_size >= r.computed, f"request {r.id} lacks blocks"
    for r in s.waiting:
        assert r.state is State.WAITING and r.computed == 0 and r.blocks == []
    owners = Counter(blk for r in s.running for blk in r.blocks)
    assert all(pool.refs(blk) == n for blk, n in owners.items()), "a block's reference count is not its owners"
    assert set(pool._free).isdisjoint(owners) and len(owners) + pool.num_free == pool.num_blocks
    if not s.kv.prefix_caching:  # only choices of one prompt share blocks then (with it, see test_prefix_cache)
        for r in s.running:
            lead = r.after or r
            assert all(owners[blk] == 1 or all(o is lead or o.after is lead for o in s.running if blk in o.blocks)
                       for blk in r.blocks), "a block owned by two requests"


def step(s: Scheduler, cost=None) -> Step:
    """One step: the scheduler's plan, checked, then its outcome applied (token 1000 + position), taking
    cost(step) seconds when a fake cost model is given."""
    planned = s.schedule()
    check(s, planned)
    s.update(planned, Outcome({e.request.id: 1000 + len(e.request.generated) for e in planned.entries if e.sample},
                              seconds=cost(planned) if cost else 0.0))
    return planned


def drain(s: Scheduler, limit: int = 10_000, cost=None) -> list[Step]:
    steps = []
    for _ in range(limit):
        if not s.busy:
            return steps
        steps.append(step(s, cost))
    raise AssertionError("the scheduler never drained")


def by_id(planned: Step) -> dict:
    return {e.request.id: e for e in planned.entries}


def assert_empty(s: Scheduler) -> None:
    kv = s.kv
    assert kv.pool.num_free == kv.pool.num_blocks, "blocks leaked"
    if kv.swap is not None:
        assert kv.swap.num_free == kv.swap.num_blocks, "swap slots leaked"
    if kv.window is not None:
        assert kv.window.blocks.num_free == kv.window.blocks.num_blocks, "window blocks leaked"
