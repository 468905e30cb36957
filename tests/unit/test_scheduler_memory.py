"""Unit tests for the memory side of the scheduler and the KV manager: policies, priorities, the safety margin,
offload and restore, the no-batch retry, and the sliding-window allocator. Pure Python, driven by drive.py."""
import random

import pytest

from drive import assert_empty, by_id, drain, req
from drive import step as step_once
from router.core.allocator import BlockAllocator
from router.core.kv import KVManager
from router.core.request import Request, State
from router.core.scheduler import Budget, Scheduler
from router.core.step import Step
from router.core.window import WindowAllocator


def make(blocks=256, block_size=4, prefill=64, total=10_000, size=16, policy="fifo", margin=0.0, swap=0,
         window=0, window_blocks=0) -> Scheduler:
    kv = KVManager(blocks, block_size, swap_blocks=swap, window=window, window_blocks=window_blocks)
    return Scheduler(Budget(prefill, total, size, 0.0, 0), kv, policy, margin)


# Policies ---------------------------------------------------------------------------------------------------

def _contended(policy: str):
    """a decodes and b is mid-prompt; both need a block and one is free."""
    s = make(blocks=3, block_size=4, prefill=8, policy=policy)
    a, b = req(4, 6), req(8, 2)
    s.add(a)
    s.add(b)
    step = step_once(s)                # a: its prompt (block 0); b: a 4-token chunk (block 1)
    assert [(e.request, e.num_tokens) for e in step.entries] == [(a, 4), (b, 4)]
    return s, a, b


@pytest.mark.parametrize("policy, gets_the_block", [("fifo", "decode"), ("prefill_first", "chunk")])
def test_policy_decides_who_gets_the_last_block(policy, gets_the_block):
    s, a, b = _contended(policy)
    assert [e.request for e in step_once(s).entries] == [a if gets_the_block == "decode" else b]
    drain(s)
    assert len(a.generated) == 6 and len(b.generated) == 2
    assert_empty(s)


def test_policies_order_the_step_entries():
    for policy, first in (("fifo", "decode"), ("prefill_first", "chunk")):
        s = make(blocks=64, block_size=4, prefill=4, policy=policy)
        a, b = req(4, 20), req(12, 2)
        s.add(a)
        step_once(s)
        s.add(b)
        step_once(s)                   # b's first chunk
        kinds = ["decode" if e.decode else "chunk" for e in step_once(s).entries]
        assert kinds[0] == first and sorted(kinds) == ["chunk", "decode"]


def test_priority_orders_admission_and_arrival_breaks_ties():
    s = make(prefill=8)
    low, high1, high2 = req(8, 1), req(8, 1), req(8, 1)
    low.priority, high1.priority, high2.priority = 5, 0, 0
    for r in (low, high1, high2):
        s.add(r)
    assert s.waiting == [high1, high2, low]
    assert [e.request for e in step_once(s).entries] == [high1]
    assert [e.request for e in step_once(s).entries] == [high2]
    assert [e.request for e in step_once(s).entries] == [low]


def test_priority_picks_the_eviction_victim():
    """The worst rank goes: an old low-priority request before a new high-priority one (without priorities
    the newest would go)."""
    for prioritized in (True, False):
        s = make(blocks=3, block_size=4)
        old, new = req(4, 8), req(4, 8)
        if prioritized:
            old.priority, new.priority = 9, 0
        s.add(old)
        s.add(new)
        for _ in range(20):
            step = step_once(s)
            if step.preempted:
                break
        assert step.preempted == ([old] if prioritized else [new])


# Safety margin ----------------------------------------------------------------------------------------------

def test_safety_margin_holds_new_prompts_but_not_running_requests():
    s = make(blocks=20, block_size=4, margin=0.25)
    a = req(58, 10)                    # 15 blocks: 5 free (25%, not below the margin)
    s.add(a)
    step_once(s)
    b = req(4, 1)
    s.add(b)
    step = step_once(s)                # b admitted (1 block) and done
    assert b in [e.request for e in step.entries] and b.state is State.FINISHED
    step_once(s)
    step_once(s)                       # a grows into a 16th block: 4 free, 20% < 25%
    assert s.kv.pool.num_free == 4
    c = req(4, 1)
    s.add(c)
    for _ in range(5):
        step = step_once(s)
        assert [e.request for e in step.entries] == [a], "below the margin only running requests go on"
    assert c.state is State.WAITING
    drain(s)
    assert c.generated
    assert_empty(s)


def test_safety_margin_is_ignored_when_nothing_runs():
    s = make(blocks=10, block_size=4, margin=0.9)
    a = req(36, 1)
    s.add(a)
    step_once(s)
    assert a.generated, "an idle server admits even below the margin"
    assert_empty(s)


def test_zero_margin_fills_the_pool():
    s = make(blocks=8, block_size=4, margin=0.0)
    for _ in range(4):
        s.add(req(8, 1))
    step = step_once(s)
    assert len(step.entries) == 4


# Offload and restore ----------------------------------------------------------------------------------------

def _pressure(swap: int):
    """Three requests whose decodes outgrow a 6-block pool (each alone needs 4 blocks)."""
    s = make(blocks=6, block_size=4, swap=swap)
    rs = [req(4, 12) for _ in range(3)]
    for r in rs:
        s.add(r)
    return s, rs


def test_offload_moves_the_newest_to_swap_and_restores_it_without_recompute():
    s, (a, b, c) = _pressure(swap=8)
    at_offload: dict[int, int] = {}
    restored = []
    for _ in range(1000):
        if not (s.running or s.waiting or s.offloaded):
            break
        step = step_once(s)
        if step.offloaded and not at_offload:
            assert step.offloaded == [c] and not step.preempted, "the newest goes first"
        for r in step.offloaded:
            assert step.tables[r.id] == [] and r not in [e.request for e in step.entries]
            at_offload[r.id] = r.computed
        for r in step.restored:
            entry = by_id(step)[r.id]
            assert not entry.first and entry.start == at_offload[r.id], "it continues where it stopped"
            assert set(step.tables[r.id]) <= {dst for _, dst in step.to_device}, "its blocks are copied back"
            restored.append((r, entry.start))
    assert at_offload and {r.id for r, _ in restored} == set(at_offload)
    assert all(r.preemptions == 0 and len(r.generated) == 12 for r in (a, b, c))
    assert_empty(s)


def test_full_swap_falls_back_to_soft_reset():
    s, (a, b, c) = _pressure(swap=1)   # too small for any request's blocks
    steps = drain(s)
    assert any(st.preempted for st in steps) and not any(st.offloaded for st in steps)
    assert_empty(s)


def test_nothing_ranked_below_an_offloaded_request_is_admitted():
    s, rs = _pressure(swap=8)
    late = None
    for _ in range(200):
        step = step_once(s)
        if s.offloaded and late is None:
            late = req(1, 1)
            s.add(late)
        if s.offloaded:
            assert late not in [e.request for e in step.entries]
        if not (s.running or s.waiting or s.offloaded):
            break
    assert late is not None and late.generated
    assert_empty(s)


def test_a_request_outranking_the_offloaded_ones_is_admitted():
    s = make(blocks=4, block_size=4, swap=8)
    big, holder = req(17, 4), req(9, 20)  # each decoding: all but its last token computed
    for r in (big, holder):
        s.add(r)
    for r, n in ((big, 4), (holder, 2)):  # as if running: big fills the pool, holder arrived later
        s.waiting.remove(r)
        r.state, r.blocks, r.computed, r.on_shards = State.RUNNING, [], 4 * n, True
        s.running.append(r)
    big.blocks = s.kv.pool.allocate(4)
    s.offload(big, Step())
    holder.blocks = s.kv.pool.allocate(2)  # big cannot come back (4 blocks, 2 free)
    low, urgent = req(2, 1), req(2, 1)
    urgent.priority = -1
    s.add(low)
    s.add(urgent)
    step = step_once(s)
    admitted = [e.request for e in step.entries if e.first]
    assert admitted == [urgent] and low.state is State.WAITING and big.state is State.OFFLOADED


def test_no_batch_at_all_evicts_and_retries_within_the_step():
    """Two prompts mid-chunk hold the whole pool: neither can continue, so the worse is evicted at once."""
    s = make(blocks=4, block_size=4, prefill=8, swap=8)
    a, b = req(16, 1), req(16, 1)
    for r in (a, b):                   # as after restores: both running, 8 tokens in, 2 blocks each
        r.state, r.blocks, r.computed, r.on_shards = State.RUNNING, s.kv.pool.allocate(2), 8, True
        s.running.append(r)
    step = step_once(s)
    assert step.offloaded == [b] and [(e.request, e.num_tokens) for e in step.entries] == [(a, 8)]
    drain(s)
    assert a.generated and b.generated and b.offloads == 1 and b.preemptions == 0
    assert_empty(s)


# Sliding window ---------------------------------------------------------------------------------------------

def test_window_table_keeps_only_blocks_a_query_can_see():
    bt = BlockAllocator(64, 4)
    win = WindowAllocator(bt, window=8)
    r = req(40, 1)
    dropped, new = win.advance(r, 0, 16)           # a chunk writes blocks 0-3
    assert (dropped, len(new)) == (0, 4)
    dropped, new = win.advance(r, 16, 1)           # query 16 sees 9..16: blocks 0, 1 are dead
    assert (dropped, len(new), r.window_base) == (2, 1, 2) and len(r.window_blocks) == 3
    dropped, new = win.advance(r, 17, 1)
    assert (dropped, len(new)) == (0, 0)
    win.release(r)
    assert bt.num_free == 64


def test_window_pool_stays_small_and_nothing_leaks():
    s = make(blocks=200, block_size=4, prefill=8, window=8, window_blocks=40)
    rs = [req(30, 20) for _ in range(4)]
    for r in rs:
        s.add(r)
    peak = 0
    for step in drain(s):
        for e in step.entries:
            assert e.request.window_base * 4 <= max(0, e.start - 8 + 1), "a visible block was dropped"
        peak = max(peak, s.kv.window.blocks.num_used)
    assert peak <= 4 * (2 + 2) + 2, f"window pool peaked at {peak} blocks"
    assert all(len(r.generated) == 20 for r in rs)
    assert_empty(s)


def test_choices_of_a_hybrid_model_compute_their_own_prompts():
    """Sliding-window layers keep no prefix to share: a later choice of a prompt computes it whole (sharing the
    full-attention blocks alone would leave its window layers without the prompt's keys)."""
    s = make(blocks=200, block_size=4, prefill=64, window=8, window_blocks=40)
    lead = req(14, 3)
    other = Request(list(lead.prompt_ids), 3, after=lead)
    s.add(lead)
    s.add(other)
    computed = {lead.id: 0, other.id: 0}
    for step in drain(s):
        for e in step.entries:
            computed[e.request.id] += e.num_tokens if e.first or not e.decode else 0
    assert computed == {lead.id: 14, other.id: 14} and s.kv.prefix_hit_blocks == 0
    assert_empty(s)


# Everything at once -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["fifo", "prefill_first"])
@pytest.mark.parametrize("seed", range(4))
def test_random_pressure_with_swap_and_priorities_finishes_everything(policy, seed):
    rng = random.Random(seed)
    s = make(blocks=24, block_size=4, prefill=12, total=96, size=6, policy=policy, swap=rng.choice([0, 6, 30]),
             margin=rng.choice([0.0, 0.15]))
    reqs = [req(rng.randint(1, 40), rng.randint(1, 30)) for _ in range(40)]
    for r in reqs:
        r.priority = rng.randint(0, 2)
    pending = list(reqs)
    for _ in range(20_000):
        while pending and rng.random() < 0.3:
            s.add(pending.pop(0))
        if not (pending or s.running or s.waiting or s.offloaded):
            break
        step = step_once(s)
        slots = [x for r in s.offloaded for x in r.swap_slots]
        assert len(slots) == len(set(slots))
        assert all(r.state is State.OFFLOADED and not r.blocks for r in s.offloaded)
        if s.running and not step.entries:
            raise AssertionError("a step with running requests scheduled nothing")
    assert all(len(r.generated) == r.max_new_tokens for r in reqs)
    assert_empty(s)


# Regressions found in review ----------------------------------------------------------------------------------

def test_a_cached_block_shared_by_one_admission_is_not_allocated_to_another_in_the_same_step():
    s = Scheduler(Budget(64, 10_000, 16, 0.0, 0), KVManager(3, 4, prefix_caching=True))
    a = req(9, 1)                      # fills blocks 0, 1 (named) and 2, then finishes: all free, 0 oldest
    s.add(a)
    step_once(s)
    assert a.state is State.FINISHED and s.kv.pool.num_free == 3
    b = Request(prompt_ids=[500, 501, 502, 503], max_new_tokens=1)   # no hit: needs a fresh block
    c = Request(prompt_ids=[0, 1, 2, 3, 7], max_new_tokens=1)        # hits block 0
    s.add(b)
    s.add(c)
    step = s.schedule()
    assert {e.request for e in step.entries} == {b, c}
    assert c.computed >= 4 and set(b.blocks).isdisjoint(c.blocks), "b was given the block c reads as its prefix"


def test_a_restored_prompt_chunk_counts_against_the_prefill_budget():
    s = make(blocks=64, block_size=4, prefill=9, swap=64)
    a, b, c = req(16, 1), req(40, 1), req(40, 1)
    for r in (a, b, c):                # all mid-prompt, 8 tokens in
        r.state, r.computed, r.on_shards, r.blocks = State.RUNNING, 8, True, s.kv.pool.allocate(2)
        s.running.append(r)
    s.offload(b, Step())
    s.offload(c, Step())
    step = s.schedule()
    assert step.prefill_tokens <= 9 and [(e.request, e.num_tokens) for e in step.entries] == [(a, 8), (b, 1)]


def test_a_decode_never_evicts_a_better_ranked_request():
    """fifo plans decodes before chunks: a low-priority decode must not evict a high-priority prompt that is
    simply not scheduled yet; it waits, and being the worst rank it is the one evicted when nothing fits."""
    s = make(blocks=4, block_size=4, prefill=64)
    low, high = req(5, 20), req(24, 2)
    low.priority, high.priority = 5, 0
    for r, computed, blocks in ((low, 4, 1), (high, 12, 3)):
        r.state, r.computed, r.on_shards, r.blocks = State.RUNNING, computed, True, s.kv.pool.allocate(blocks)
        s.running.append(r)
    step = s.schedule()
    assert step.preempted == [low] and [e.request for e in step.entries] == [high]
