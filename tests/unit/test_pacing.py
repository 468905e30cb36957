"""The pacer (router/core/pacing.py) and the scheduler under it, on a fake cost model: pure Python, no timing."""
import pytest

from drive import by_id, drain, req
from drive import step as run_step
from router.core.kv import KVManager
from router.core.pacing import Pacer
from router.core.scheduler import Budget, Scheduler

BASE, PER_DECODE, PER_TOKEN = 0.030, 0.002, 0.001  # the fake machine: seconds per step, decode, prompt token


def fake_cost(step) -> float:
    return BASE + PER_DECODE * step.decodes + PER_TOKEN * step.prefill_tokens


def make(ratio=2.0, prefill=512) -> Scheduler:
    return Scheduler(Budget(prefill, 1 << 16, 64, 0.0, 0), KVManager(4096, 16), pacer=Pacer(ratio))


def test_the_pacer_learns_a_linear_machine():
    pacer = Pacer(2.0)
    assert pacer.prompt_tokens(8) is None  # nothing seen yet: no bound
    for d in (4, 8, 12, 8, 4, 16):
        pacer.observe(d, 0, BASE + PER_DECODE * d)
    assert pacer.prompt_tokens(8) is None  # no step with prompt tokens yet
    for d, n in ((8, 100), (4, 40), (12, 300)):
        pacer.observe(d, n, BASE + PER_DECODE * d + PER_TOKEN * n)
    assert pacer.decode_step(10) == pytest.approx(BASE + PER_DECODE * 10)
    assert pacer.per_prompt_token == pytest.approx(PER_TOKEN)
    assert pacer.prompt_tokens(10) == int((BASE + PER_DECODE * 10) / PER_TOKEN)  # ratio 2: one more decode step
    assert Pacer(3.0).prompt_tokens(0) is None
    assert pacer.prompt_tokens(0) is None  # nothing decodes: nobody to hold up


def test_a_slow_machine_still_moves_prompts_on():
    pacer = Pacer(1.1, min_tokens=16)
    pacer.observe(2, 0, 0.01)
    pacer.observe(2, 100, 10.0)
    assert pacer.prompt_tokens(2) == 16


@pytest.mark.parametrize("ratio", [0, 1, 0.5])
def test_a_ratio_at_or_below_one_is_refused(ratio):
    with pytest.raises(ValueError):
        Pacer(ratio)


@pytest.mark.parametrize("ratio", [1.5, 2.0, 3.0])
def test_steps_beside_decodes_stay_within_the_ratio(ratio):
    """Eight requests decode, then a 2,000-token prompt arrives: once the pacer has seen both kinds of step,
    every step that carries prompt tokens beside decodes costs at most `ratio` decode-only steps, and the prompt
    still gets through."""
    s = make(ratio)
    decoders = [req(20, 400) for _ in range(8)]
    for r in decoders:
        s.add(r)
    for _ in range(5):
        run_step(s, fake_cost)
    long = req(2000, 5)
    s.add(long)
    chunks, ratios = [], []
    while long.computed < len(long.prompt_ids):
        step = run_step(s, fake_cost)
        e = by_id(step).get(long.id)
        if e is not None:
            chunks.append(e.num_tokens)
        assert all(d.id in by_id(step) for d in decoders)  # the decodes go on every step
        if step.prefill_tokens:
            ratios.append(fake_cost(step) / (BASE + PER_DECODE * step.decodes))
    assert sum(chunks) == 2000
    learned = ratios[1:]  # the first chunk step teaches the pacer the prompt-token cost
    assert max(learned) <= ratio + 1e-9
    assert min(learned[:-1]) >= ratio - 0.05, "the chunk should fill the target, not undershoot it"
    drain(s, cost=fake_cost)


def test_nothing_decoding_takes_the_whole_prefill_budget():
    s = make(2.0, prefill=512)
    r = req(20, 3)
    s.add(r)
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
