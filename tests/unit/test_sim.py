"""cb-sim without a server: the simulator (production scheduler + cost model) against hand-computed schedules,
the cost-model fit, trace replay, and the CLI. Pure Python, no torch, no timing thresholds."""
import math

import pytest
from typer.testing import CliRunner

from bench.sim import scenarios
from bench.sim.cli import app
from bench.sim.cost_model import CostModel, calibrate, step_features, timed_steps
from bench.sim.replay import replay, trace_requests
from bench.sim.simulator import simulate_continuous, simulate_static
from bench.workloads import EXAMPLE_LENGTHS, Req, arrival_times, short_requests, worked_example
from router.api.info import Info
from router.core.scheduler import Budget


def budget(prefill: int, total: int, size: int) -> Budget:
    return Budget(prefill, total, size, waiting_served_ratio=0.3, max_waiting_tokens=20)


ROOMY = budget(4096, 1 << 20, 4)


def config(b: Budget, num_blocks: int, block_size: int = 16) -> dict:
    return {"budget": b, "num_blocks": num_blocks, "block_size": block_size}


def fifo_list_schedule(lengths, slots):
    """By hand: each job in order takes the slot that frees first; returns each job's completion step."""
    free = [0] * slots
    done = []
    for n in lengths:
        k = free.index(min(free))
        free[k] += n
        done.append(free[k])
    return done


def one_token_prompts(lengths):
    return [Req(i, 1, n, prompt_ids=[100]) for i, n in enumerate(lengths)]


def by_id(result):
    return {r["id"]: r for r in result.records}


def test_example_lengths():
    assert len(EXAMPLE_LENGTHS) == 12 and sum(EXAMPLE_LENGTHS) == 4250
    assert min(EXAMPLE_LENGTHS) == 100 and max(EXAMPLE_LENGTHS) == 1000


def test_example_static():
    res = simulate_static(worked_example(), batch_size=4)
    assert res.steps == 1000 + 700 + 500 == res.total
    assert res.generated == 4250
    assert math.isclose(res.utilisation, 4250 / (4 * 2200))  # 48%
    # every request of a group completes when the group does: 4 x 1000, 4 x 1700, 4 x 2200
    assert sorted(r["e2e"] for r in res.records) == [1000] * 4 + [1700] * 4 + [2200] * 4
    assert math.isclose(res.mean_completion, 19600 / 12)  # 1,633


def test_example_continuous_is_fifo_list_scheduling():
    res = simulate_continuous(worked_example(), ROOMY, num_blocks=4096, block_size=16)
    hand = fifo_list_schedule(EXAMPLE_LENGTHS, 4)
    assert [by_id(res)[i]["e2e"] for i in range(12)] == hand
    assert res.steps == max(hand) == 1150 == res.total
    assert math.isclose(res.utilisation, 4250 / (4 * 1150))  # 92%
    assert math.isclose(res.mean_completion, 635)
    static = simulate_static(worked_example(), batch_size=4)
    assert round(static.mean_completion / res.mean_completion, 1) == 2.6
    assert res.preemptions == 0


def test_small_case_by_hand():
    # 2 slots, lengths 4, 2, 3, 1. Static: (4, 2) then (3, 1) = 4 + 3 = 7 steps.
    # Continuous: A runs 0-4; B runs 0-2; 3 starts on B at 2 and ends at 5; 1 starts on A at 4 and ends at 5.
    reqs = one_token_prompts([4, 2, 3, 1])
    cont = simulate_continuous(reqs, budget(4096, 1 << 20, 2), 1024, 16)
    static = simulate_static(reqs, 2)
    assert [by_id(cont)[i]["e2e"] for i in range(4)] == [4, 2, 5, 5]
    assert [by_id(static)[i]["e2e"] for i in range(4)] == [4, 4, 7, 7]
    assert (cont.steps, static.steps) == (5, 7)
    # first tokens: the prefill step yields one; request 2 is admitted at step 2 (its token at time 3)
    assert [by_id(cont)[i]["ttft"] for i in range(4)] == [1, 1, 3, 5]
    assert all(r["tokens"] == r["max_new_tokens"] for r in cont.records + static.records)


def test_arrivals_in_time_and_cost_model_seconds():
    cost = CostModel(overhead_s=0.01, per_prefill_token_s=0.001, per_decode_s=0.002, per_kv_token_s=0.0)
    # one request alone: prefill of 10 tokens (0.01 + 0.010), then 2 decodes (0.01 + 0.002 each)
    res = simulate_continuous([Req(0, 10, 3)], ROOMY, 64, 16, cost, times=[5.0])
    rec = res.records[0]
    assert math.isclose(rec["ttft"], 0.02) and math.isclose(rec["e2e"], 0.044)
    assert math.isclose(res.total, 5.044) and res.steps == 3


def test_step_features():
    # a 3-token decode context, a 10-token prompt chunk at 0, a chunk continuing at 64
    assert step_features([(3, 1), (0, 10), (64, 8)]) == (1.0, 18, 1, 4 + 10 + 72)


def test_calibration_recovers_a_known_cost_model():
    truth = CostModel(0.004, 20e-6, 150e-6, 30e-9, source="truth")
    reqs = [Req(i, 20 + 13 * i % 200, 10 + 7 * i % 120) for i in range(40)]
    times = arrival_times(40, 50.0, "poisson", seed=3)
    sim = simulate_continuous(reqs, budget(128, 4096, 16), 256, 16, truth, times, record=True)
    fitted = calibrate(sim.decisions)
    for got, want in zip(fitted.coefficients, truth.coefficients):
        assert math.isclose(got, want, rel_tol=1e-3, abs_tol=1e-12)
    assert fitted.fit["r2"] > 0.999


def test_timed_steps_skip_idle_gaps():
    # two requests far apart in time: the gap while the router sits idle is not a step's duration
    reqs = [Req(0, 4, 2), Req(1, 4, 2)]
    sim = simulate_continuous(reqs, ROOMY, 64, 16, CostModel(0.01), times=[0.0, 100.0], record=True)
    assert all(t < 1.0 for _, t in timed_steps(sim.decisions))


def test_replay_of_a_simulated_trace_with_preemptions_and_chunking():
    """A tight KV pool forces soft resets and a small prefill budget chunks prompts; the recorded decisions,
    replayed by step index, come out identical."""
    reqs = [Req(i, 30 + 11 * i % 50, 20 + 5 * i % 30) for i in range(12)]
    b = budget(48, 400, 8)
    sim = simulate_continuous(reqs, b, 25, 16, times=arrival_times(12, 0.2, "fixed"), record=True)
    assert sim.preemptions > 0
    assert any(e[2] not in (1, r.prompt_tokens) for d in sim.decisions for e in d["entries"] for r in reqs
               if r.id == e[0] and e[1] == 0)  # some prompt was chunked
    assert all(r["tokens"] == r["max_new_tokens"] for r in sim.records)
    diffs, again = replay(sim.decisions, b, 25, 16)
    assert diffs == []
    assert len(again.decisions) == len(sim.decisions)


def test_replay_reports_a_difference():
    reqs = [Req(i, 20, 5) for i in range(4)]
    b = budget(64, 1024, 4)
    sim = simulate_continuous(reqs, b, 64, 16, record=True)
    lines = [dict(d) for d in sim.decisions]
    lines[1] = {**lines[1], "entries": lines[1]["entries"][:-1]}
    diffs, _ = replay(lines, b, 64, 16)
    assert diffs and diffs[0].startswith("step 1: entries")


def test_trace_requests_use_the_count_actually_generated():
    lines = [{"arrivals": [{"id": 7, "prompt_tokens": 5, "max_new_tokens": 50, "priority": 0}], "finished": [],
              "entries": [], "preempted": []},
             {"arrivals": [], "finished": [[7, 12]], "entries": [], "preempted": []}]
    reqs, at = trace_requests(lines)
    assert (reqs[0].id, reqs[0].max_new_tokens, at) == (7, 12, [0])


def test_budget_sweep_answers_the_operator():
    reqs = short_requests(60, seed=1)
    times = arrival_times(60, 8.0, "poisson", seed=1)
    cost = CostModel(0.002, 10e-6, 50e-6, 5e-9)
    table = scenarios.budget_sweep(reqs, times, config(budget(512, 4096, 8), 0), cost, [512, 4096], [16, 256])
    assert set(table) == {(512, 16), (512, 256), (4096, 16), (4096, 256)}
    slo = max(s["ttft_p99_ms"] for s in table.values()) + 1
    text = scenarios.format_budget_sweep(table, slo, 10)
    assert "answer: the smallest --max-batch-total-tokens" in text and "512" in text
    assert "no configuration" in scenarios.format_budget_sweep(table, 0.0, 10)


def test_rate_sweep_continuous_never_worse_than_static():
    series = scenarios.rate_sweep(lambda: short_requests(80, seed=2), [4.0, 16.0],
                                  config(budget(4096, 1 << 20, 4), 4096), CostModel(0.0025), static_batch=4)
    for (_, s), (_, c) in zip(series["static"], series["continuous"]):
        assert c["mean_wait"] <= s["mean_wait"]
        assert c["utilisation"] >= s["utilisation"]


def test_cli_example_and_poisson(tmp_path):
    runner = CliRunner()
    out = runner.invoke(app, [])
    assert out.exit_code == 0, out.output
    assert "2200" in out.output and "1150" in out.output and "48.3%" in out.output and "92.4%" in out.output
    out = runner.invoke(app, ["--scenario", "poisson", "--num-prompts", "40", "--rates", "4,12",
                              "--plot", str(tmp_path / "s.png"), "--json", str(tmp_path / "s.json")])
    assert out.exit_code == 0, out.output
    assert (tmp_path / "s.png").stat().st_size > 1000 and (tmp_path / "s.json").exists()


def test_cli_replay_and_sweep(tmp_path):
    import json
    reqs = [Req(i, 40, 8) for i in range(6)]
    sim = simulate_continuous(reqs, budget(64, 512, 4), 32, 16, CostModel(0.01, 1e-5), record=True)
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(d) + "\n" for d in sim.decisions))
    info = Info(model_id="smollm2", model_dtype="float32", model_device_type="cpu", quantize=None,
                num_shard=1,
                max_input_tokens=64, max_total_tokens=128, max_batch_total_tokens=512, max_batch_prefill_tokens=64,
                max_batch_size=4, waiting_served_ratio=0.3, max_waiting_tokens=20, max_concurrent_requests=16,
                block_size=16, num_blocks=32, num_swap_blocks=0, num_window_blocks=0, scheduler="fifo",
                safety_margin=0.0, prefix_caching=True, max_stop_sequences=4, max_top_n_tokens=5)
    bench = tmp_path / "r.json"
    bench.write_text(json.dumps({"server_info": info.model_dump(), "summary": {"wall_s": 1.0}}))
    runner = CliRunner()
    out = runner.invoke(app, ["--replay", str(trace), "--from-bench", str(bench)])
    assert out.exit_code == 0 and "identical decisions" in out.output, out.output
    out = runner.invoke(app, ["--scenario", "random", "--num-prompts", "30", "--request-rate", "5",
                              "--calibrate", str(trace), "--sweep", "--sweep-total-tokens", "1024,4096",
                              "--sweep-prefill-tokens", "64,512", "--ttft-slo-ms", "100000"])
    assert out.exit_code == 0, out.output
    assert "answer:" in out.output


def resumptions(sim):
    """The first entry of each preempted request after its soft reset."""
    out, waiting = [], set()
    for d in sim.decisions:
        for e in d["entries"]:
            if e[0] in waiting:
                out.append(e)
                waiting.discard(e[0])
        waiting |= set(d["preempted"])
    return out


def test_a_soft_reset_request_finds_its_own_blocks_again():
    """The total-token budget, not the pool, forces the resets, so freed blocks keep their names; with prefix
    caching (the server's default) a re-admitted request resumes after its cached blocks, as the router does."""
    reqs = [Req(i, 40, 30) for i in range(6)]
    b = budget(512, 256, 8)
    on = simulate_continuous(reqs, b, 200, 16, record=True, prefix_caching=True)
    off = simulate_continuous(reqs, b, 200, 16, record=True, prefix_caching=False)
    assert on.preemptions > 0 and off.preemptions > 0
    assert any(e[1] > 0 for e in resumptions(on)) and all(e[1] == 0 for e in resumptions(off))
    assert replay(on.decisions, b, 200, 16)[0] == []
    assert replay(off.decisions, b, 200, 16, prefix_caching=False)[0] == []


def test_paced_runs_replay_identically_and_pace_chunks():
    """With the pacer on, chunk sizes depend on measured step times; each trace line carries the time of the step
    before it, so the replay's pacer learns the same and decides the same."""
    reqs = [Req(i, 20, 60) for i in range(6)] + [Req(6, 900, 4)]
    times = [0.0] * 6 + [0.5]
    cost = CostModel(0.03, 0.001, 0.002)
    b = budget(512, 1 << 16, 16)
    sim = simulate_continuous(reqs, b, 4096, 16, cost, times, record=True, prefill_step_ratio=2.0)
    long = [e[2] for d in sim.decisions for e in d["entries"] if e[0] == 6 and e[2] > 1]
    assert sum(long) == 900 and max(long) < 512, "the long prompt is paced in chunks below the budget"
    diffs, _ = replay(sim.decisions, b, 4096, 16, cost, prefill_step_ratio=2.0)
    assert diffs == []
    unpaced = simulate_continuous(reqs, b, 4096, 16, cost, times, record=True)
    assert max(e[2] for d in unpaced.decisions for e in d["entries"] if e[0] == 6) == 512
