"""cb-sim's replica mode (bench/sim/replicas.py): the routing policies, and N production schedulers behind them
driven by a closed-loop client, checked against schedules computed by hand. Pure Python, no timing thresholds."""
from bench.sim.cost_model import CostModel
from bench.sim.replicas import BALANCE_ABS, Router, scheduler_factory, simulate_replicas
from bench.workloads import Req, shared_prefix_workload
from router.core.scheduler import Budget

CONFIG = {"budget": Budget(4096, 1 << 20, 4, 0.0, 20), "num_blocks": 4096, "block_size": 4}


def test_round_robin_takes_turns_and_least_loaded_the_idlest():
    rr = Router("round_robin", 3)
    assert [rr.pick([1]) for _ in range(5)] == [0, 1, 2, 0, 1]
    ll = Router("least_loaded", 2)
    assert [ll.pick([1]), ll.pick([1])] == [0, 1]
    ll.finished(1)
    assert ll.pick([1]) == 1


def test_cache_aware_keeps_a_prefix_on_its_replica_until_the_loads_part():
    router = Router("cache_aware", 2)
    a, b = [1] * 20, [2] * 20
    assert router.pick(a + [7]) == 0
    assert router.pick(b + [7]) == 1                    # no match: the replica holding fewer prompt tokens
    assert [router.pick(a + [k]) for k in range(5)] == [0] * 5
    assert router.pick(b + [9]) == 1
    for _ in range(BALANCE_ABS + 1):                   # replica 0 loaded past the threshold: balance instead
        router.pick(a + [3])
    assert router.pick(a + [4]) == 1


def test_two_replicas_halve_independent_work_and_serve_everything():
    reqs = [Req(i, 4, 10, prompt_ids=[100 + i] * 4) for i in range(8)]
    unit = CostModel(1.0)  # one unit a step, whatever it holds
    one, _ = simulate_replicas(reqs, 1, "round_robin", 8, scheduler_factory(CONFIG), unit)
    two, extra = simulate_replicas(reqs, 2, "round_robin", 8, scheduler_factory(CONFIG), unit)
    # 4 slots a replica: one replica runs two waves of 4 (1 prefill + 9 decodes, then again) = 20 steps; two run one
    assert one.total == 20 and two.total == 10
    assert extra["served_per_replica"] == [4, 4] and len(two.records) == 8
    assert all(r["tokens"] == 10 for r in two.records)


def test_the_client_sends_the_next_request_only_as_one_finishes():
    reqs = [Req(i, 4, 5, prompt_ids=[100 + i] * 4) for i in range(4)]
    sim, _ = simulate_replicas(reqs, 2, "round_robin", 1, scheduler_factory(CONFIG), CostModel(1.0))
    assert sim.total == 4 * 5  # one at a time: 5 steps each, nothing overlaps


def test_cache_aware_reuses_more_prefix_than_round_robin():
    reqs = shared_prefix_workload(docs=3, questions=4, doc_words=40, max_new_tokens=2)
    for r in reqs:  # ids standing in for a tokenizer: one per word
        r.prompt_ids = [hash(w) % 50_000 for w in r.text.split()]
    results = {p: simulate_replicas(reqs, 2, p, 1, scheduler_factory(CONFIG), CostModel(1.0))[1]["hit_rate"]
               for p in ("round_robin", "cache_aware")}
    assert results["cache_aware"] > results["round_robin"] > 0
