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
    assert pacer.prompt_cost() == pytest.approx((PER_TOKEN, PER_KEY))
    for start in (0, 500, 1500):
        n = pacer.prompt_tokens(10, start)
        added = lambda k: PER_TOKEN * k + PER_KEY * keys_read(start, k)  # noqa: E731
        assert added(n) <= alone(10) + 1e-12 < added(n + 1)  # ratio 2: at most one more decode-only step
    assert pacer.prompt_tokens(10, 1500) < pacer.prompt_tokens(10, 0), "late chunks of a long prompt cost more"
    assert pacer.prompt_tokens(0) is None  # nothing decodes: nobody to hold up


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
    assert sum(sizes) == 2000
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
