"""cb-bench: workloads, arrivals and statistics directly; the client against a fake server; then one real server
with a trace file: a burst through cb-bench's client, replayed through the simulator, which must make the same
scheduling decisions at every step; and the cb-bench command itself. No timing thresholds."""
import asyncio
import json
import math
import subprocess
import sys
import threading
import time

import pytest

from launcher import bench_client
from launcher.bench_stats import parse_slos, percentile, side_by_side, summarize
from launcher.cost_model import read_trace
from launcher.replay import budget_from_info, replay, scheduler_options
from launcher.workloads import arrival_times, load_w64, random_workload
from conftest import REPO, Server, free_port


def test_w64_is_replayed_exactly():
    reqs = load_w64()
    assert len(reqs) == 64
    assert sum(r.prompt_tokens for r in reqs) == 9046 and sum(r.max_new_tokens for r in reqs) == 8571
    assert all(r.inputs == r.prompt_ids for r in reqs)


def test_arrivals():
    assert arrival_times(3) == [0.0, 0.0, 0.0]
    assert arrival_times(4, 2.0, "fixed") == [0.0, 0.5, 1.0, 1.5]
    poisson = arrival_times(2000, 10.0, "poisson", seed=1)
    assert poisson == sorted(poisson) and poisson == arrival_times(2000, 10.0, "poisson", seed=1)
    assert 150 < poisson[-1] < 250  # mean gap 0.1 s
    with pytest.raises(ValueError):
        arrival_times(3, 1.0, "uniform")


def test_random_workload_lengths():
    reqs = random_workload(50, 100, 20, 0.5, seed=3)
    assert all(50 <= r.prompt_tokens <= 150 and 10 <= r.max_new_tokens <= 30 for r in reqs)
    assert all(len(r.prompt_ids) == r.prompt_tokens for r in reqs)


def rec(ttft, itl, tokens=None, error=None):
    tokens = tokens if tokens is not None else len(itl) + 1
    return {"id": 0, "prompt_tokens": 10, "max_new_tokens": tokens, "tokens": tokens, "ttft": ttft, "itl": itl,
            "e2e": (ttft or 0.0) + sum(itl), "error": error, "generated_tokens": tokens}


def test_summary_percentiles_goodput_and_errors():
    assert percentile([1, 2, 3, 4], 50) == 2.5 and math.isnan(percentile([], 50))
    recs = [rec(0.1, [0.01, 0.01]), rec(0.5, [0.02, 0.04]), rec(None, [], tokens=0, error="overloaded: busy")]
    recs[2]["max_new_tokens"] = 3
    s = summarize(recs, wall=2.0, slos=parse_slos("ttft:200 tpot:50"))
    assert s["completed"] == 2 and s["errors_by_type"] == {"overloaded": 1} and s["mismatches"] == 1
    assert math.isclose(s["ttft_p50_ms"], 300) and math.isclose(s["itl_mean_ms"], 20)
    assert math.isclose(s["tpot_p50_ms"], 20) and s["good_requests"] == 1 and s["goodput_req_s"] == 0.5
    assert s["output_tokens"] == 6 and s["output_tok_s"] == 3.0
    with pytest.raises(ValueError):
        parse_slos("itl:5")
    assert "TTFT p99" in side_by_side([("cb", s), ("static", s)])


@pytest.fixture(scope="module")
def fake_server():
    """A stand-in for the router's SSE stream, to test the client's parsing and error handling alone."""
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()

    @app.post("/generate_stream")
    async def stream(body: dict):
        n = body["parameters"]["max_new_tokens"]
        if n > 100:
            return JSONResponse({"error": "too many", "error_type": "validation"}, status_code=422)

        async def events():
            for i in range(n):
                await asyncio.sleep(0.001)
                last = i == n - 1
                ev = {"token": {"id": i, "text": "x"}, "generated_text": "x" * n if last else None,
                      "details": {"finish_reason": "length", "generated_tokens": n} if last else None}
                yield f"data:{json.dumps(ev)}\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_client_against_a_fake_server(fake_server):
    reqs = random_workload(5, 8, 6, 0.5, seed=1)
    reqs[4].max_new_tokens = 500
    recs, wall = bench_client.run(fake_server, reqs, arrival_times(5, 50.0, "fixed"), max_concurrency=2,
                                  progress=False)
    assert [r["tokens"] for r in recs[:4]] == [r.max_new_tokens for r in reqs[:4]]
    assert all(len(r["itl"]) == r["tokens"] - 1 and r["ttft"] is not None for r in recs[:4])
    assert recs[4]["error"] == "validation: too many"
    assert [r["start"] for r in recs] == sorted(r["start"] for r in recs) and wall > 0


@pytest.fixture(scope="module")
def traced_server(tmp_path_factory):
    """Small budgets so prompts are chunked and requests queue: many decisions for the replay to agree on."""
    trace = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    s = Server("--trace-file", str(trace), "--max-batch-prefill-tokens", "64", "--max-batch-total-tokens", "256",
               "--max-batch-size", "6", "--max-input-tokens", "96", "--max-total-tokens", "128")
    s.trace = trace
    yield s
    s.stop()


def test_simulator_decides_as_the_live_router(traced_server):
    reqs = random_workload(10, 40, 8, 0.6, seed=7)
    recs, _ = bench_client.run(traced_server.url, reqs, progress=False)
    assert [r["error"] for r in recs] == [None] * 10
    assert [r["tokens"] for r in recs] == [r.max_new_tokens for r in reqs]
    lines = read_trace(traced_server.trace)
    assert sum(len(line["arrivals"]) for line in lines) == 10
    assert any(e[1] > 0 and e[2] > 1 for line in lines for e in line["entries"])  # a prompt was chunked
    budget, num_blocks, block_size = budget_from_info(traced_server.info())
    diffs, sim = replay(lines, budget, num_blocks, block_size, **scheduler_options(traced_server.info()))
    assert diffs == [], "\n".join(diffs[:10])
    assert len(sim.decisions) == len(lines)
    print(f"{len(lines)} steps, {sim.preemptions} preemptions, identical")


def test_cb_bench_command(traced_server, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "launcher.bench", "--url", traced_server.url, "--dataset-name", "random",
         "--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "4", "--request-rate", "20",
         "--goodput", "ttft:60000", "--no-ceiling", "--no-progress", "--result-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Output token throughput" in out.stdout and "Request goodput" in out.stdout
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["summary"]["output_tokens"] == 16 and result["summary"]["errors"] == 0
    assert result["server_info"]["max_batch_size"] == 6
    assert (tmp_path / "bench_cdf_rate-inf.png").exists() is False
    assert (tmp_path / "bench_cdf_rate-20.png").stat().st_size > 1000


def test_text_workload(tmp_path):
    from launcher.workloads import text_workload, token_ids
    path = tmp_path / "prompts.txt"
    path.write_text("Hello there\n\nThe capital of France is\n")
    reqs = text_workload(path, output_len=8, n=3)
    assert [r.inputs for r in reqs] == ["Hello there", "The capital of France is", "Hello there"]
    assert all(r.max_new_tokens == 8 and r.prompt_tokens == 0 for r in reqs)
    with pytest.raises(ValueError):
        token_ids(reqs[0])  # the baselines need ids: a tokenizer must have been given

    def fake_tokenizer(text, add_special_tokens=False):
        return {"input_ids": [len(w) for w in text.split()]}
    reqs = text_workload(path, output_len=8, tokenizer=fake_tokenizer)
    assert [r.prompt_tokens for r in reqs] == [2, 5] and token_ids(reqs[1]) == [3, 7, 2, 6, 2]
