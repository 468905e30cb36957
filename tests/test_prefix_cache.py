"""Prefix caching in the pure block table and scheduler: shared blocks, reference counts, lazy eviction."""
import random

from router.block_table import BlockTable
from router.request import Request, State
from router.scheduler import Budget, Scheduler

BS = 4


def make(blocks=32, prefill=64, total=1024, size=16) -> Scheduler:
    return Scheduler(Budget(prefill, total, size, 0.0, 20), BlockTable(blocks, BS, prefix_caching=True))


def run_step(s: Scheduler):
    """One step with the router's bookkeeping: finished requests leave first, sampled ones get a token."""
    for r in [r for r in s.running if r.is_done_generating]:
        s.finish(r)
    step = s.schedule()
    for e in step.entries:
        if e.sample:
            e.request.generated.append(1000 + len(e.request.generated))
    return step


def until_done(s: Scheduler, limit=500):
    for _ in range(limit):
        if not (s.running or s.waiting):
            return
        run_step(s)
    raise AssertionError("requests never finished")


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
    assert s.prefix_hit_blocks == 3
    assert all(refs(s)[blk] == 2 for blk in a.blocks[:3])
    until_done(s)
    assert s.blocks.num_free == s.blocks.num_blocks


def test_fully_cached_prompt_still_computes_its_last_token():
    s = make()
    prompt = list(range(1, 9))                       # exactly two blocks
    s.add(Request(list(prompt), 1))
    until_done(s)
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
    until_done(s)
    assert s.blocks.num_free == 8
    hit, _ = s.blocks.lookup(list(range(1, 9)))
    assert len(hit) == 2                             # free, yet still cached
    filler = Request(list(range(200, 224)), 1)       # 6 blocks: the two least recently freed are evicted first
    s.add(filler)
    until_done(s)
    assert s.blocks.lookup(list(range(1, 9)))[0] == []  # its first block went first: the chain is broken


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
                assert s.blocks._refs[blk] == n      # one reference per owning request
            assert len(owners) + s.blocks.num_free == s.blocks.num_blocks
            assert all(r.state is State.WAITING and not r.blocks for r in s.waiting)
        assert not pending and not s.running and not s.waiting
        assert s.blocks.num_free == s.blocks.num_blocks and s.prefix_hit_blocks > 0
