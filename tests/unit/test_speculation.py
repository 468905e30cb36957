"""Prompt-lookup speculation in the pure scheduler: proposals come from the request's own context, a step carries
them after the last token and samples at each, the outcome's extra tokens join the request and its cache goes
back to what was accepted; nothing leaks, every block table stays consistent, and a request whose drafts fail
rests."""
from drive import check
from router.core.kv import KVManager
from router.core.request import Request
from router.core.scheduler import Budget, Scheduler
from router.core.speculation import MAX_BATCH, REST_STEPS, Speculator
from router.core.step import Outcome

BS = 4


def make(n: int = 4, blocks: int = 64) -> Scheduler:
    return Scheduler(Budget(64, 4096, 16, 0.0, 20), KVManager(blocks, BS, prefix_caching=True),
                     speculator=Speculator(n))


def test_proposals_follow_the_latest_earlier_occurrence():
    spec = Speculator(3)
    req = Request([5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 1, 5, 6], 10)
    assert spec.propose(req, 1, 10) == [7, 1, 5]  # (5, 6) last seen at 7-8, followed by 7, 1, 5
    assert spec.propose(req, 1, 2) == [7, 1]      # no more than the room
    assert spec.propose(req, MAX_BATCH + 1, 10) == []
    assert Speculator(3).propose(Request([1, 2, 3, 4], 10), 1, 10) == []


def run(s: Scheduler, model) -> None:
    """Steps until drained; `model(tokens)` is the next token the 'model' gives after a context; the shard's
    verification is mirrored: drafts accepted while they equal the model's tokens, then one more."""
    for _ in range(10_000):
        if not s.busy:
            return
        step = s.schedule()
        check(s, step)
        tokens, more = {}, {}
        for e in step.entries:
            if not e.sample:
                continue
            context = list(e.request.tokens)
            produced = [model(context)]
            for d in e.drafts:
                if d != produced[-1]:
                    break
                context = context + [d]
                produced.append(model(context))
            tokens[e.request.id], more[e.request.id] = produced[0], produced[1:]
        s.update(step, Outcome(tokens, more=more))
    raise AssertionError("never drained")


def test_speculated_output_is_what_the_model_gives_and_nothing_leaks():
    cycle = [11, 12, 13, 14, 15]
    model = lambda ctx: cycle[(cycle.index(ctx[-1]) + 1) % 5] if ctx[-1] in cycle else 11  # noqa: E731
    s = make()
    reqs = [Request([1, 2, 11, 12, 13, 14, 15, 11], 30, speculate=True),
            Request([3, 11, 12, 13, 14], 17, speculate=True)]
    for r in reqs:
        s.add(r)
    run(s, model)
    for r in reqs:
        expected, ctx = [], list(r.prompt_ids)
        while len(expected) < r.max_new_tokens:
            expected.append(model(ctx))
            ctx.append(expected[-1])
        assert r.generated == expected and r.finish_reason == "length"
    assert s.speculator.accepted > 20 and s.kv.pool.num_used == 0


def test_a_request_whose_drafts_fail_rests_then_tries_again():
    spec = Speculator(4)
    req = Request([1, 2, 3, 1, 2], 40)
    assert spec.propose(req, 1, 8) == [3, 1, 2]
    spec.observe(req, 3, 1)           # one in three: the moving average stays above MIN_RATE
    assert spec.propose(req, 1, 8)
    spec.observe(req, 3, 0)
    assert spec.propose(req, 1, 8)
    spec.observe(req, 3, 0)           # none twice: it rests
    assert [spec.propose(req, 1, 8) for _ in range(REST_STEPS)] == [[]] * REST_STEPS
    assert spec.propose(req, 1, 8) == [3, 1, 2]
    spec.forget(req)
    assert not spec.contexts
