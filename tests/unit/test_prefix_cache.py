"""Prefix caching in the pure KV manager and scheduler: shared blocks, reference counts, lazy eviction."""
import random

import pytest

from drive import drain, step as run_step
from router.core.kv import KVManager
from router.core.request import Request, State
from router.core.scheduler import Budget, Scheduler

BS = 4


def make(blocks=32, prefill=64, total=1024, size=16, prefix_caching=True) -> Scheduler:
    return Scheduler(Budget(prefill, total, size, 0.0, 20), KVManager(blocks, BS, prefix_caching=prefix_caching))


def lookup(s: Scheduler, tokens: list[int]) -> list[int]:
    """The cached blocks a prompt of `tokens` plus one more token would start with."""
    return s.kv.lookup(Request(tokens + [0], 1)).blocks


def refs(s: Scheduler) -> dict:
    out = {}
    for r in s.running:
        for b in r.blocks:
            out[b] = out.get(b, 0) + 1
    return out


def test_shared_prefix_is_reused_and_refcounted():
    s = make()
    prefix = list(range(1, 13))                      # three full blocks
    a = Request(prefix + [50, 51], 3)
    s.add(a)
    run_step(s)                                      # a's prompt computed: its 3 full blocks are named
    b = Request(prefix + [60, 61, 62], 3)
    s.add(b)
    step = run_step(s)
    entry = next(e for e in step.entries if e.request is b)
    assert entry.first and entry.start == 12 and entry.num_tokens == 3
    assert b.blocks[:3] == a.blocks[:3] and entry.new_blocks[:3] == a.blocks[:3]
    assert s.kv.prefix_hit_blocks == 3
    assert all(refs(s)[blk] == 2 for blk in a.blocks[:3])
    drain(s)
    assert s.kv.pool.num_free == s.kv.pool.num_blocks


def test_fully_cached_prompt_still_computes_its_last_token():
    s = make()
    prompt = list(range(1, 9))                       # exactly two blocks
    s.add(Request(list(prompt), 1))
    drain(s)
    again = Request(list(prompt), 1)
    s.add(again)
    step = run_step(s)
    (entry,) = step.entries
    assert entry.start == 4 and entry.num_tokens == 4  # the second block holds the last token: recomputed
    assert entry.sample


def test_freed_blocks_keep_their_content_until_evicted_lru():
    s = make(blocks=8)
    a = Request(list(range(1, 9)) + [99], 1)         # 3 blocks, 2 of them full
    s.add(a)
    drain(s)
    assert s.kv.pool.num_free == 8
    assert len(lookup(s, list(range(1, 9)))) == 2    # free, yet still cached
    filler = Request(list(range(200, 224)), 1)       # 6 blocks: the two least recently freed are evicted first
    s.add(filler)
    drain(s)
    assert lookup(s, list(range(1, 9))) == []        # its first block went first: the chain is broken


def test_random_traffic_with_shared_prefixes_never_leaks_or_double_books():
    for seed in range(4):
        rng = random.Random(seed)
        s = make(blocks=24, prefill=16, total=96, size=6)
        prefixes = [[rng.randrange(1, 500) for _ in range(8)] for _ in range(3)]
        pending = [Request(rng.choice(prefixes) + [rng.randrange(1, 500) for _ in range(rng.randint(1, 9))],
                           rng.randint(1, 8)) for _ in range(30)]
        for _ in range(2000):
            if pending and rng.random() < 0.3:
                s.add(pending.pop())
            if not (pending or s.running or s.waiting):
                break
            run_step(s)
            owners = refs(s)
            for blk, n in owners.items():
                assert s.kv.pool.refs(blk) == n      # one reference per owning request
            assert len(owners) + s.kv.pool.num_free == s.kv.pool.num_blocks
            assert all(r.state is State.WAITING and not r.blocks for r in s.waiting)
        assert not pending and not s.running and not s.waiting
        assert s.kv.pool.num_free == s.kv.pool.num_blocks and s.kv.prefix_hit_blocks > 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_choices_of_one_prompt_compute_it_once(prefix_caching):
    """n choices arrive together: the later ones wait until the first's prompt is cached (over several chunks),
    then compute only its partial last block, sharing every full block of the first's table (with or without
    prefix caching); a cancelled first choice frees them."""
    s = make(prefill=8, prefix_caching=prefix_caching)
    prompt = list(range(1, 15))                      # 3 full blocks and 2 tokens
    lead = Request(prompt, 3)
    others = [Request(list(prompt), 3, after=lead) for _ in range(3)]
    for r in [lead, *others]:
        s.add(r)
    computed = {r.id: 0 for r in [lead, *others]}
    while any(r.state is State.WAITING for r in others):
        step = run_step(s)
        for e in step.entries:
            computed[e.request.id] += e.num_tokens if e.first or not e.decode else 0
        assert all(r.state is State.WAITING for r in others) or lead.computed >= len(prompt)
    drain(s)
    assert computed[lead.id] == len(prompt)
    assert all(computed[r.id] == len(prompt) - 12 for r in others), computed  # the 2 tokens past the full blocks
    assert s.kv.prefix_hit_blocks == 9 and s.kv.prefix_lookups == (4 if prefix_caching else 3)  # the lead looks up too
    cancelled = Request(prompt + [99], 2)
    follower = Request(prompt + [99], 2, after=cancelled)
    s.add(cancelled)
    s.add(follower)
    assert follower.gated
    s.finish(cancelled)
    assert not follower.gated
    drain(s)
    assert s.kv.pool.num_used == 0
