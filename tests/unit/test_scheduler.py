"""Unit tests for router.core.scheduler, driven directly (pure Python: no torch, no grpc) through drive.py."""
import random

import pytest

from drive import by_id, req
from drive import step as run_step
from router.core.kv import KVManager
from router.core.request import Request, State
from router.core.scheduler import Budget, Scheduler


def make(prefill=64, total=1024, size=16, blocks=256, block_size=4, ratio=0.3, max_wait=20) -> Scheduler:
    return Scheduler(Budget(prefill, total, size, ratio, max_wait), KVManager(blocks, block_size))


# 1. Budgets every step, in a randomized simulation ---------------------------------------------------------

def simulate(seed: int, pool_blocks: int, n=60, max_steps=20_000) -> tuple[Scheduler, list[Request], int]:
    rng = random.Random(seed)
    s = make(prefill=24, total=160, size=5, blocks=pool_blocks, block_size=4, ratio=0.3, max_wait=4)
    # Prompts up to 60 tokens (many longer than the 24-token prefill budget); every request fits the pool alone.
    reqs = [req(rng.randint(1, 60), rng.randint(1, 30)) for _ in range(n)]
    pending = list(reqs)
    preemptions = 0
    for _ in range(max_steps):
        for _ in range(rng.choice([0, 0, 0, 1, 1, 2, 4])):   # staggered arrivals, sometimes bursts
            if pending:
                s.add(pending.pop(0))
        if not pending and not s.running and not s.waiting:
            break
        preemptions += len(run_step(s).preempted)
    else:
        pytest.fail(f"seed {seed}: not done after {max_steps} steps")
    return s, reqs, preemptions


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("pool_blocks", [30, 40, 64])   # pool below, equal to and above the 160-token budget
def test_random_simulation_respects_budgets_and_returns_blocks(seed, pool_blocks):
    s, reqs, _ = simulate(seed, pool_blocks)
    for r in reqs:
        assert r.state is State.FINISHED and len(r.generated) == r.max_new_tokens and r.blocks == []
    assert s.kv.pool.num_free == s.kv.pool.num_blocks


def test_small_pool_simulation_really_preempts():
    assert sum(simulate(seed, 30)[2] for seed in range(3)) > 0, "the small pool should force preemptions"


def test_decodes_respect_total_token_budget():
    """Pool (64 tokens) larger than the budget (10): decode growth must not push held tokens past 10.

    Each request alone fits the budget (4 + 6 tokens), as validation guarantees; together they do not."""
    s = make(prefill=32, total=10, size=8, blocks=16, block_size=4)
    a, b = req(4, 6), req(4, 6)
    s.add(a)
    s.add(b)
    for _ in range(60):
        if not s.running and not s.waiting:
            break
        run_step(s)                  # check() asserts held_tokens <= 10 after every step
    assert a.state is b.state is State.FINISHED and s.kv.pool.num_free == 16


# 2. Chunked prefill interleaved with decodes ---------------------------------------------------------------

def test_long_prompt_is_chunked_while_decodes_continue():
    s = make(prefill=8, total=1024, size=8)
    d = req(4, 50)
    s.add(d)
    run_step(s)                      # d prefilled, now decoding
    long = req(30, 2)
    s.add(long)
    starts = []
    for i in range(4):
        step = run_step(s)
        es = by_id(step)
        assert es[d.id].decode and es[d.id].num_tokens == 1 and es[d.id].sample
        e = es[long.id]
        assert not e.decode and e.first == (i == 0)
        assert e.sample == (i == 3), "only the last chunk samples"
        starts.append((e.start, e.num_tokens))
        assert step.prefill_tokens <= 8
    assert starts == [(0, 8), (8, 8), (16, 8), (24, 6)]
    assert len(d.generated) == 5 and len(long.generated) == 1
    step = run_step(s)               # both decode now
    assert all(e.decode and e.num_tokens == 1 for e in step.entries) and len(step.entries) == 2


# 3-5. Admission: waiting_served_ratio and max_waiting_tokens ------------------------------------------------

def start_running(s: Scheduler, r: int) -> list[Request]:
    rs = [req(4, 1000) for _ in range(r)]
    for x in rs:
        s.add(x)
    step = run_step(s)               # nothing running: all admitted at once
    assert len(step.entries) == r and s.steps_since_admission == 0
    return rs


def test_single_arrival_waits_below_served_ratio_then_enough_are_admitted_together():
    s = make(ratio=0.5, max_wait=100)
    start_running(s, 4)              # floor(4 * 0.5) = 2 must be admissible at once
    a = req(4, 5)
    s.add(a)
    for _ in range(10):
        step = run_step(s)
        assert a.id not in by_id(step) and list(s.waiting) == [a] and a.state is State.WAITING
        assert len(step.entries) == 4
    b = req(4, 5)
    s.add(b)
    step = run_step(s)
    es = by_id(step)
    assert es[a.id].first and es[b.id].first and not s.waiting
    assert len(s.running) == 6 and s.steps_since_admission == 0


@pytest.mark.parametrize("max_wait", [1, 3, 7])
def test_lone_arrival_admitted_after_max_waiting_tokens_steps(max_wait):
    s = make(ratio=1.0, max_wait=max_wait)
    start_running(s, 3)              # floor(3 * 1.0) = 3 > 1: the ratio alone never admits one request
    a = req(4, 5)
    s.add(a)
    refused = 0
    while a.state is State.WAITING:
        step = run_step(s)
        if a.state is State.WAITING:
            refused += 1
            assert s.steps_since_admission == refused
        assert refused <= max_wait
    assert refused == max_wait
    assert by_id(step)[a.id].first and s.steps_since_admission == 0


def test_arrival_after_long_idle_stretch_is_admitted_at_once():
    s = make(ratio=1.0, max_wait=3)
    start_running(s, 3)
    for _ in range(5):
        run_step(s)                  # nothing waiting, the counter still grows
    a = req(4, 5)
    s.add(a)
    assert a.id in by_id(run_step(s))


@pytest.mark.parametrize("ratio, max_wait", [(0.3, 20), (10.0, 1000)])
def test_with_nothing_running_any_arrival_is_admitted_at_once(ratio, max_wait):
    s = make(ratio=ratio, max_wait=max_wait)
    a = req(5, 1)
    s.add(a)
    step = run_step(s)
    assert by_id(step)[a.id].first and a.state is State.FINISHED   # max_new_tokens=1: done after one step
    b = req(3, 2)                    # once everything finished, the next lone arrival goes straight in
    s.add(b)
    assert by_id(run_step(s))[b.id].first and b.state is State.RUNNING


# 6. Preemption ----------------------------------------------------------------------------------------------

def test_preemption_requeues_newest_at_head_and_frees_its_blocks():
    s = make(prefill=32, total=16, size=8, blocks=4, block_size=4)
    a, b, c, w = req(7, 5), req(2, 4), req(3, 3), req(2, 1)   # arrival order a < b < c < w
    for x in (a, b, c, w):
        s.add(x)
    step = run_step(s)               # a: 2 blocks, b: 1, c: 1; w does not fit
    assert set(by_id(step)) == {a.id, b.id, c.id} and s.kv.pool.num_free == 0
    assert not run_step(s).preempted  # every decode fits its last block
    c_tokens = list(c.tokens)
    assert len(c.generated) == 2

    step = run_step(s)               # a needs its 3rd block: c (newest, unscheduled) is preempted, not b
    assert step.preempted == [c]
    assert c.state is State.WAITING and c.computed == 0 and c.blocks == [] and c.preemptions == 1
    assert c.tokens == c_tokens and c.generated == [1000, 1001]
    assert list(s.waiting) == [c, w], "preempted request goes to the head of the queue"
    assert c not in s.running and a in s.running and b in s.running
    es = by_id(step)
    assert es[a.id].new_blocks and es[b.id].decode and c.id not in es

    step = run_step(s)               # b needs a block but a is already scheduled: b waits, nobody is preempted
    assert not step.preempted and set(by_id(step)) == {a.id} and b in s.running and len(b.blocks) == 1

    seen_c_again = None
    for _ in range(200):
        if not s.running and not s.waiting:
            break
        step = run_step(s)
        if c.id in by_id(step) and seen_c_again is None:
            seen_c_again = by_id(step)[c.id]
    assert seen_c_again is not None and seen_c_again.first and seen_c_again.start == 0
    assert all(x.state is State.FINISHED for x in (a, b, c, w))
    assert c.generated[:2] == [1000, 1001] and len(c.generated) == 3
    assert s.kv.pool.num_free == s.kv.pool.num_blocks


def test_long_queue_keeps_being_admitted_under_a_small_prefill_budget():
    """Many waiting, only one prompt fits per step: one is admitted every step (no max_waiting_tokens stall)."""
    s = make(ratio=0.3, max_wait=1000, prefill=8)
    start_running(s, 2)
    waiting = [req(8, 50) for _ in range(10)]
    for x in waiting:
        s.add(x)
    for i in range(8):               # while waiting >= floor(running * 0.3)
        run_step(s)
        assert sum(x.state is not State.WAITING for x in waiting) == i + 1
    run_step(s)                      # 2 waiting < floor(10 * 0.3): the running batch is served first
    assert sum(x.state is not State.WAITING for x in waiting) == 8


def test_a_step_that_preempts_admits_nobody():
    """The victim must not come straight back in the step that freed its blocks (preemption thrash)."""
    s = make(prefill=64, total=1024, blocks=4, block_size=4)
    old, new = req(4, 20), req(4, 20)
    s.add(old)
    run_step(s)
    s.add(new)
    run_step(s)
    for _ in range(10):
        step = run_step(s)
        if step.preempted:
            assert step.preempted == [new]
            assert new not in [e.request for e in step.entries] and list(s.waiting) == [new]
            return
    raise AssertionError("no preemption happened")
