"""TGI's wire contract beyond /generate: compat route, details, stop sequences, headers, tokenize, metrics,
cancellation, API key and payload limit — against the real server."""
import threading
import time

import httpx
import pytest
import torch

from conftest import Server, assert_idle, metric, stream_events
from test_correctness import LONG_SEED, SHORT


def test_compat_route_returns_a_list_and_streams(server):
    body = {"inputs": SHORT[0], "parameters": {"max_new_tokens": 6}}
    plain = httpx.post(server.url + "/", json=body, timeout=60).json()
    assert isinstance(plain, list) and len(plain) == 1
    assert plain[0]["generated_text"] == server.generate(SHORT[0], max_new_tokens=6)["generated_text"]
    with httpx.stream("POST", server.url + "/", json={**body, "stream": True}, timeout=60) as r:
        events = [line for line in r.iter_lines() if line.startswith("data:")]
    assert len(events) == 6


def test_prompt_logprobs_match_transformers_across_chunks(server, reference):
    ids = reference.tokenizer(LONG_SEED[0] * 4)["input_ids"][:150]  # 150 > 64: three prefill chunks
    out = server.generate(ids, max_new_tokens=2, details=True, decoder_input_details=True)
    prefill = out["details"]["prefill"]
    assert [p["id"] for p in prefill] == ids and prefill[0]["logprob"] is None
    with torch.inference_mode():
        logits = reference.model(torch.tensor([ids])).logits[0].log_softmax(-1)
    expected = logits[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    served = torch.tensor([p["logprob"] for p in prefill[1:]])
    assert torch.allclose(served, expected, atol=1e-3)


def test_top_n_tokens(server):
    out = server.generate(SHORT[4], max_new_tokens=5, details=True, top_n_tokens=3)
    for token, top in zip(out["details"]["tokens"], out["details"]["top_tokens"]):
        assert len(top) == 3 and top[0]["id"] == token["id"]
        assert top[0]["logprob"] >= top[1]["logprob"] >= top[2]["logprob"]
        assert abs(top[0]["logprob"] - token["logprob"]) < 1e-5


def test_stop_sequence_across_token_boundary(server):
    free = server.generate(SHORT[0], max_new_tokens=10, details=True)
    pieces = [t["text"] for t in free["details"]["tokens"]]
    stop = pieces[0][-2:] + pieces[1][:1]  # the end of one token and the start of the next
    events = list(stream_events(server.url, SHORT[0], max_new_tokens=10, stop=[stop]))
    assert events[-1]["details"]["finish_reason"] == "stop_sequence"
    assert len(events) == 2
    streamed = "".join(e["token"]["text"] for e in events if not e["token"]["special"])
    assert streamed == events[-1]["generated_text"] and stop in streamed


def test_timing_headers_tokenize_info_health(server, reference):
    r = httpx.post(server.url + "/generate", json={"inputs": SHORT[1], "parameters": {"max_new_tokens": 3}},
                   timeout=60)
    for h in ("x-compute-type", "x-compute-time", "x-total-time", "x-validation-time", "x-queue-time",
              "x-inference-time", "x-time-per-token", "x-prompt-tokens", "x-generated-tokens"):
        assert h in r.headers
    assert r.headers["x-generated-tokens"] == "3"
    tokens = httpx.post(server.url + "/tokenize", json={"inputs": SHORT[1]}, timeout=10).json()
    assert [t["id"] for t in tokens] == reference.tokenizer(SHORT[1])["input_ids"]
    assert "".join(t["text"] for t in tokens) == SHORT[1]
    info = server.info()
    for key in ("model_id", "model_dtype", "max_input_tokens", "max_total_tokens", "max_stop_sequences",
                "max_concurrent_requests", "router", "version"):
        assert key in info
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_cut_streams_return_every_block(server):
    cancelled_before = _outcome(server.url, "cancelled")
    threads = []

    def cut():
        with httpx.stream("POST", server.url + "/generate_stream", timeout=120,
                          json={"inputs": SHORT[2], "parameters": {"max_new_tokens": 200, "ignore_eos": True}}) as r:
            for i, line in enumerate(r.iter_lines()):
                if i >= 6:
                    return  # leaving the block closes the connection mid-stream

    for _ in range(20):
        threads.append(threading.Thread(target=cut))
        threads[-1].start()
    for t in threads:
        t.join()
    wait_for(lambda: _outcome(server.url, "cancelled") - cancelled_before == 20)
    assert_idle(server.url, timeout=60)
    assert server.generate(SHORT[0], max_new_tokens=3)["generated_text"]


def wait_for(condition, timeout: float = 60) -> None:
    """Cancellations are noticed asynchronously (at the next step): poll rather than race."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.2)


def _outcome(url: str, outcome: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == "tgi_request_outcome_total" and s.labels.get("outcome") == outcome:
                return s.value
    return 0.0


def test_metrics_parse_and_move(server):
    count = metric(server.url, "tgi_request_count_total")
    success = _outcome(server.url, "success")
    server.generate(SHORT[3], max_new_tokens=2)
    assert metric(server.url, "tgi_request_count_total") == count + 1
    assert _outcome(server.url, "success") == success + 1
    assert metric(server.url, "cb_kv_blocks_total") > 0


@pytest.fixture(scope="module")
def guarded():
    s = Server("--max-batch-total-tokens", "2048", "--api-key", "s3cret", "--payload-limit", "2000",
               "--max-total-tokens", "1024")
    yield s
    s.stop()


def test_api_key_and_payload_limit(guarded):
    url = guarded.url
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/info").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200
    r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 401 and r.json()["error_type"] == "authentication"
    assert httpx.post(url + "/generate", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    ok = httpx.post(url + "/generate", json=body, headers={"Authorization": "Bearer s3cret"}, timeout=60)
    assert ok.status_code == 200
    big = {"inputs": "x" * 5000, "parameters": {"max_new_tokens": 2}}
    r = httpx.post(url + "/generate", json=big, headers={"Authorization": "Bearer s3cret"}, timeout=60)
    assert r.status_code == 413 and r.json()["error_type"] == "payload_too_large"
    chunked = (part for part in [b'{"inputs": "', b"y" * 5000, b'"}'])  # no Content-Length: read and cut off
    r = httpx.post(url + "/generate", content=chunked, timeout=60,
                   headers={"Authorization": "Bearer s3cret", "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error_type"] == "payload_too_large"


def test_non_streaming_client_that_leaves_is_cancelled(server):
    cancelled_before = _outcome(server.url, "cancelled")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/generate", timeout=2,
                   json={"inputs": SHORT[5], "parameters": {"max_new_tokens": 400, "ignore_eos": True}})
    wait_for(lambda: _outcome(server.url, "cancelled") == cancelled_before + 1)
    assert_idle(server.url, timeout=60)


def test_sglang_router_probes_are_answered(server):
    """sglang-router registers a worker by reading SGLang's /model_info and /server_info (or their older /get_
    names): cb answers both, naming its model, so the balancer routes OpenAI requests to it by that name."""
    info = server.info()
    for path in ("/model_info", "/get_model_info"):
        body = httpx.get(server.url + path, timeout=10).json()
        assert body["model_path"] == body["served_model_name"] == info["model_id"] and body["is_generation"]
    for path in ("/server_info", "/get_server_info"):
        body = httpx.get(server.url + path, timeout=10).json()
        assert body["served_model_name"] == info["model_id"] and body["tp_size"] == info["num_shard"]
        assert body["max_total_num_tokens"] == info["max_batch_total_tokens"]
