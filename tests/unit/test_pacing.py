"""The pacer (router/core/pacing.py) and the scheduler under it, on a fake cost model: pure Python, no timing."""
import pytest

from drive import by_id, drain, req
from drive import step as run_step
from router.core.kv import KVManager
from router.core.pacing import Pacer, keys_read
from router.core.scheduler import Budget, Scheduler

# The fake machine: seconds per step, per decode, per prompt token, per key a prompt token attends to.
BASE, PER_DECODE, PER_TOKEN, PER_KEY = 0.030, 0.002, 0.001, 1e-6


def alone(decodes: int) -> float:
    return BASE + PER_DECODE * decodes


def fake_cost(step) -> float:
    return (alone(step.decodes) + PER_TOKEN * step.prefill_tokens
            + PER_KEY * sum(keys_read(s, n) for s, n in step.chunks))


def make(ratio=2.0, prefill=512) -> Scheduler:
    return Scheduler(Budget(prefill, 1 << 16, 64, 0.0, 0), KVManager(4096, 16), pacer=Pacer(ratio))


def test_the_pacer_learns_the_machine():
    pacer = Pacer(2.0)
    assert pacer.prompt_tokens(8) is None  # nothing seen yet: no bound
    for d in (4, 8, 12, 8, 4, 16):
        pacer.observe(d, [], alone(d))
    assert pacer.prompt_tokens(8) is None  # no step with prompt tokens yet
    for d, start, n in ((8, 0, 100), (4, 300, 40), (12, 900, 300), (8, 1500, 60)):
        pacer.observe(d, [(start, n)], alone(d) + PER_TOKEN * n + PER_KEY * keys_read(start, n))
    assert pacer.decode_step(10) == pytest.approx(alone(10))
    assert pacer.prompt_cost() == pytest.approx((0.0, PER_TOKEN, PER_KEY))
    for start in (0, 500, 1500):
        n = pacer.prompt_tokens(10, start)
        added = lambda k: PER_TOKEN * k + PER_KEY * keys_read(start, k)  # noqa: E731
        assert added(n) <= alone(10) + 1e-12 < added(n + 1)  # ratio 2: at most one more decode-only step
    assert pacer.prompt_tokens(10, 1500) < pacer.prompt_tokens(10, 0), "late chunks of a long prompt cost more"
    assert pacer.prompt_tokens(0) is None  # nothing decodes: nobody to hold up


def test_what_any_prompt_chunk_costs_a_step_is_learned_apart():
    """A chunk costs its step something whatever its size (on CPU such a step leaves the compiled sizes): fitted
    apart from its tokens, small chunks are not taken as nearly free."""
    fixed, pacer = 0.01, Pacer(1.7)
    for d in (1, 16, 64):  # what Warmup times (shard/calibration.py), then one served step
        pacer.observe(d, [], alone(d))
    for d, start, n in ((16, 0, 64), (16, 0, 512), (16, 512, 64), (8, 100, 30)):
        pacer.observe(d, [(start, n)], alone(d) + fixed + PER_TOKEN * n + PER_KEY * keys_read(start, n))
    assert pacer.prompt_cost() == pytest.approx((fixed, PER_TOKEN, PER_KEY))
    n = pacer.prompt_tokens(8)
    added = lambda k: fixed + PER_TOKEN * k + PER_KEY * keys_read(0, k)  # noqa: E731
    assert added(n) <= 0.7 * alone(8) + 1e-12 < added(n + 1)


def test_a_slow_machine_still_moves_prompts_on():
    pacer = Pacer(1.1, min_tokens=16)
    pacer.observe(2, [], 0.01)
    pacer.observe(2, [(0, 100)], 10.0)
    assert pacer.prompt_tokens(2) == 16


@pytest.mark.parametrize("ratio", [0, 1, 0.5])
def test_a_ratio_at_or_below_one_is_refused(ratio):
    with pytest.raises(ValueError):
        Pacer(ratio)


@pytest.mark.parametrize("ratio", [1.5, 2.0, 3.0])
def test_steps_beside_decodes_stay_within_the_ratio(ratio):
    """Eight requests decode, then a 2,000-token prompt arrives: once the pacer has seen a few chunks, every step
    that carries prompt tokens beside decodes costs at most `ratio` decode-only steps and close to it, and the
    prompt gets through."""
    s = make(ratio)
    decoders = [req(20, 400) for _ in range(8)]
    for r in decoders:
        s.add(r)
    for _ in range(5):
        run_step(s, fake_cost)
    long = req(2000, 5)
    s.add(long)
    sizes, ratios = [], []
    while long.computed < len(long.prompt_ids):
        step = run_step(s, fake_cost)
        assert all(d.id in by_id(step) for d in decoders)  # the decodes go on every step
        if step.prefill_tokens:
            sizes.append(step.prefill_tokens)
            ratios.append(fake_cost(step) / alone(step.decodes))
    assert sum(sizes) in (1999, 2000)  # a last chunk of one token goes as a decode (Request.is_decoding)
    learned = [r for r, n in zip(ratios[3:-1], sizes[3:-1]) if n > 16]  # past the first chunks, before the
    assert learned and max(learned) <= ratio + 1e-9                      # last, above the 16-token minimum
    assert min(learned) >= ratio - 0.1, "the chunk should fill the target (to a token), not undershoot it"
    assert sizes[-2] < sizes[3], "later chunks are smaller: their tokens attend to more keys"
    drain(s, cost=fake_cost)


def test_nothing_decoding_takes_the_whole_prefill_budget():
    s = make(2.0, prefill=512)
    s.add(req(20, 3))
    drain(s, cost=fake_cost)  # the pacer has seen decode-only and prompt steps
    long = req(2000, 2)
    s.add(long)
    assert by_id(run_step(s, fake_cost))[long.id].num_tokens == 512


def test_without_a_pacer_the_budget_alone_bounds_chunks():
    s = Scheduler(Budget(512, 1 << 16, 64, 0.0, 0), KVManager(4096, 16))
    for r in [req(20, 400) for _ in range(8)]:
        s.add(r)
    for _ in range(5):
        run_step(s, fake_cost)
    long = req(2000, 5)
    s.add(long)
    assert by_id(run_step(s, fake_cost))[long.id].num_tokens == 512


def calibrated(ratio=1.7) -> Pacer:
    """A pacer started as the router starts it: from the steps Warmup timed (shard/calibration.py's plan)."""
    pacer = Pacer(ratio)
    pacer.calibrate([(d, s, n, alone(d) + PER_TOKEN * n + PER_KEY * keys_read(s, n))
                     for d, s, n in ((1, 0, 0), (16, 0, 0), (64, 0, 0), (16, 0, 64), (16, 0, 512), (16, 512, 64))])
    return pacer


def test_warmup_steps_give_the_model_before_any_request():
    """Fitted on one request's steps alone, a decode-only step of 64 looked as cheap as one; Warmup's timed
    steps of 1, 16 and 64 decodes (and chunks beside 16) make it right from the start."""
    pacer = calibrated()
    assert pacer.decode_step(64) == pytest.approx(alone(64))
    assert pacer.prompt_cost() == pytest.approx((0.0, PER_TOKEN, PER_KEY))
    for _ in range(20):  # a lone request's steps do not undo it
        pacer.observe(1, [], alone(1))
    assert pacer.decode_step(64) == pytest.approx(alone(64))


def test_a_burst_is_not_paced_to_spare_the_few_admitted_first():
    """Sixty prompts queued beside four decodes: the step may carry many more prompt tokens than a long prompt
    already admitted beside eight streams, which moves at the ratio."""
    pacer = calibrated(1.7)
    lone = pacer.prompt_tokens(8, 0, queued=0)
    added = PER_TOKEN * lone + PER_KEY * keys_read(0, lone)
    assert added <= 0.7 * alone(8) + 1e-12 < PER_TOKEN * (lone + 1) + PER_KEY * keys_read(0, lone + 1)
    burst = pacer.prompt_tokens(4, 0, queued=60)
    assert burst > 10 * pacer.prompt_tokens(4, 0, queued=0)
    assert PER_TOKEN * burst + PER_KEY * keys_read(0, burst) <= (1.7 * 16 - 1) * alone(4) + 1e-12


def test_a_burst_after_a_lone_request_reaches_full_batches_quickly():
    """W64's shape after one lone request: the scheduler admits the burst in a few large steps, not hundreds of
    16-token chunks."""
    s = Scheduler(Budget(512, 1 << 16, 64, 0.0, 0), KVManager(4096, 16), pacer=calibrated(1.7))
    s.add(req(30, 8))
    drain(s, cost=fake_cost)
    burst = [req(141, 130) for _ in range(64)]
    for r in burst:
        s.add(r)
    steps = 0
    while any(r.computed < len(r.prompt_ids) for r in burst):
        run_step(s, fake_cost)
        steps += 1
    # at least 18 steps of 512 prompt tokens; paced as if nothing were queued it took 169 on this fake machine
    # (whose prompt tokens are dear: 1 ms each), 48 with the queue counted
    assert steps <= 55, steps
    drain(s, cost=fake_cost)
