"""cb-bench against servers: the client against a fake one; then one real server with a trace file: a burst through
cb-bench's client, replayed through the simulator, which must make the same scheduling decisions at every step;
and the cb-bench command itself. No timing thresholds."""
import asyncio
import json
import subprocess
import sys
import threading
import time

import pytest

from bench import client
from bench.sim.cost_model import read_trace
from bench.sim.replay import replay, server_config
from bench.workloads import arrival_times, random_workload
from conftest import REPO, Server, free_port
from router.api.info import Info


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

    @app.post("/v1/completions")
    async def completions(body: dict):
        """llama-server's shape: a chunk per token, a last one with the finish reason and usage, [DONE]; except
        that the second and third tokens share a chunk, as a step's tokens do in vLLM's stream."""
        n = body["max_tokens"]
        if n > 100:
            return JSONResponse({"error": {"message": "too many", "type": "invalid_request_error",
                                           "code": "validation"}}, status_code=400)

        async def chunks():
            for text in ["x"] * min(n, 1) + ["xx"] * (n >= 3) + ["x"] * (n - 1 - 2 * (n >= 3)):
                await asyncio.sleep(0.001)
                yield f"data: {json.dumps({'choices': [{'text': text, 'finish_reason': None}]})}\n\n"
            last = {"choices": [{"text": "", "finish_reason": "length"}], "usage": {"completion_tokens": n}}
            yield f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n"
        return StreamingResponse(chunks(), media_type="text/event-stream")

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


@pytest.mark.parametrize("backend", sorted(client.BACKENDS))
def test_client_against_a_fake_server(fake_server, backend):
    reqs = random_workload(5, 8, 6, 0.5, seed=1)
    reqs[4].max_new_tokens = 500
    recs, wall = client.run(fake_server, reqs, arrival_times(5, 50.0, "fixed"), max_concurrency=2,
                            progress=False, backend=client.BACKENDS[backend]())
    assert [r["tokens"] for r in recs[:4]] == [r.max_new_tokens for r in reqs[:4]]
    assert [r["generated_tokens"] for r in recs[:4]] == [r.max_new_tokens for r in reqs[:4]]
    merged = backend == "openai"  # the count comes from usage, ITL from the chunks
    assert all(r.get("chunks", r["tokens"]) == r["tokens"] - (merged and r["tokens"] >= 3) for r in recs[:4])
    assert all(len(r["itl"]) == r.get("chunks", r["tokens"]) - 1 and r["ttft"] is not None for r in recs[:4])
    assert recs[4]["error"] == "validation: too many"
    assert [r["start"] for r in recs] == sorted(r["start"] for r in recs) and wall > 0


@pytest.mark.parametrize("backend", sorted(client.BACKENDS))
def test_latency_tools_against_a_fake_server(fake_server, backend, tmp_path):
    """bench.interference and bench.concurrency measure what they say, on any backend."""
    from typer.testing import CliRunner

    from bench import concurrency, interference

    r = interference.measure(fake_server, backend, streams=3, stream_tokens=20, long_prompt=30, arrive_after=0.01,
                             seed=0)
    assert r["itl_p99_ms"] >= r["itl_p50_ms"] > 0 and r["worst_gap_ms"] >= r["itl_p99_ms"]
    assert r["long_ttft_s"] > 0 and r["long_started_s"] >= 0.01
    out = tmp_path / "conc.json"
    result = CliRunner().invoke(concurrency.app, ["measure", "--url", fake_server, "--backend", backend, "--levels",
                                                  "1,4", "--input-len", "8", "--output-len", "10", "--json", str(out)])
    assert result.exit_code == 0, result.output
    points = json.loads(out.read_text())["points"]
    assert [p["concurrency"] for p in points] == [1, 4] and all(p["output_tok_s"] > 0 for p in points)
    result = CliRunner().invoke(concurrency.app, ["plot", str(out), "--out", str(tmp_path / "c.png")])
    assert result.exit_code == 0 and (tmp_path / "c.png").stat().st_size > 0, result.output


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
    recs, _ = client.run(traced_server.url, reqs, progress=False)
    assert [r["error"] for r in recs] == [None] * 10
    assert [r["tokens"] for r in recs] == [r.max_new_tokens for r in reqs]
    lines = read_trace(traced_server.trace)
    assert sum(len(line["arrivals"]) for line in lines) == 10
    assert any(e[1] > 0 and e[2] > 1 for line in lines for e in line["entries"])  # a prompt was chunked
    diffs, sim = replay(lines, **server_config(Info.model_validate(traced_server.info())))
    assert diffs == [], "\n".join(diffs[:10])
    assert len(sim.decisions) == len(lines)
    print(f"{len(lines)} steps, {sim.preemptions} preemptions, identical")


def test_cb_bench_command(traced_server, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "bench.cli", "--url", traced_server.url, "--dataset-name", "random",
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
