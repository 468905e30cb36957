"""Bad and hostile input on every route: a refusal is a 4xx JSON error in the route's shape (TGI's on TGI's routes,
OpenAI's under /v1/), never a 5xx; hostile but valid input generates; requests running beside it are undisturbed."""
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import assert_idle
from test_correctness import SHORT

TGI_ROUTES = ["/generate", "/generate_stream", "/"]
OPENAI_ROUTES = ["/v1/completions", "/v1/chat/completions"]


class Raw(str):
    """A JSON number written as is: NaN, Infinity, 1e400 (what clients other than Python's json may send)."""


NAN, INF, NEG_INF, HUGE = Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e400")


def dump(value) -> str:
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{dump(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dump(v) for v in value) + "]"
    return json.dumps(value)


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity, which are not JSON."""
    def refuse(token):
        raise ValueError(f"{token} in a response")
    return json.loads(text, parse_constant=refuse)


def post(url: str, body, path: str = "/generate", timeout: float = 120) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else dump(body)
    return httpx.post(url + path, content=content, headers={"Content-Type": "application/json"}, timeout=timeout)


def assert_error_shape(r: httpx.Response, path: str, status: int = 422) -> dict:
    """A 4xx in the route's shape; returns TGI's body or OpenAI's `error` object."""
    assert r.status_code == status, f"{path}: {r.status_code} {r.text[:500]}"
    body = strict_json(r.text)
    if path.startswith("/v1/"):
        err = body["error"]
        assert err["message"] and err["type"] == "invalid_request_error" and set(err) == {"message", "type",
                                                                                          "param", "code"}
        return err
    assert body["error"] and body["error_type"] and set(body) == {"error", "error_type"}
    return body


def sse_events(r: httpx.Response) -> list:
    return [strict_json(line[5:]) for line in r.text.splitlines() if line.startswith("data:") and line[5:].strip()
            != "[DONE]"]


BAD = {
    "empty inputs": {"inputs": "", "parameters": {"max_new_tokens": 5}},
    "empty token ids": {"inputs": [], "parameters": {"max_new_tokens": 5}},
    "too many input tokens": {"inputs": "hello " * 1500, "parameters": {"max_new_tokens": 5}},
    "max_new_tokens 0": {"inputs": "hello", "parameters": {"max_new_tokens": 0}},
    "max_new_tokens -1": {"inputs": "hello", "parameters": {"max_new_tokens": -1}},
    "max_new_tokens 2**64": {"inputs": "hello", "parameters": {"max_new_tokens": 2**64}},
    "beyond max_total_tokens": {"inputs": "hello", "parameters": {"max_new_tokens": 5000}},
    "negative temperature": {"inputs": "hello", "parameters": {"temperature": -1.0}},
    "temperature -0.0": {"inputs": "hello", "parameters": {"temperature": -0.0}},
    "temperature NaN": {"inputs": "hello", "parameters": {"temperature": NAN}},
    "temperature Infinity": {"inputs": "hello", "parameters": {"temperature": INF}},
    "temperature 1e400": {"inputs": "hello", "parameters": {"temperature": HUGE}},
    "temperature 'NaN' as a string": {"inputs": "hello", "parameters": {"temperature": "NaN"}},
    "repetition_penalty NaN": {"inputs": "hello", "parameters": {"repetition_penalty": NAN}},
    "repetition_penalty 'NaN' as a string": {"inputs": "hello", "parameters": {"repetition_penalty": "NaN"}},
    "repetition_penalty 0": {"inputs": "hello", "parameters": {"repetition_penalty": 0}},
    "frequency_penalty -Infinity": {"inputs": "hello", "parameters": {"frequency_penalty": NEG_INF}},
    "frequency_penalty 3": {"inputs": "hello", "parameters": {"frequency_penalty": 3}},
    "top_p above 1": {"inputs": "hello", "parameters": {"top_p": 1.5}},
    "top_p Infinity": {"inputs": "hello", "parameters": {"top_p": INF}},
    "typical_p 0": {"inputs": "hello", "parameters": {"typical_p": 0}},
    "typical_p NaN": {"inputs": "hello", "parameters": {"typical_p": NAN}},
    "top_k 0": {"inputs": "hello", "parameters": {"top_k": 0}},
    "top_k -1": {"inputs": "hello", "parameters": {"top_k": -1}},
    "top_k 2.5": {"inputs": "hello", "parameters": {"top_k": 2.5}},
    "token id out of vocabulary": {"inputs": [1, 99999999], "parameters": {"max_new_tokens": 5}},
    "token id 2**64": {"inputs": [2**64], "parameters": {"max_new_tokens": 5}},
    "negative token id": {"inputs": [-1], "parameters": {"max_new_tokens": 5}},
    "inputs a number": {"inputs": 5},
    "lone surrogate in inputs": {"inputs": "a\ud800b", "parameters": {"max_new_tokens": 2}},
    "lone surrogate in a stop sequence": {"inputs": "hello", "parameters": {"stop": ["\udfff"]}},
    "parameters a list": {"inputs": "hello", "parameters": []},
    "missing inputs": {"parameters": {"max_new_tokens": 5}},
    "empty stop sequence": {"inputs": "hello", "parameters": {"stop": [""]}},
    "stop a string": {"inputs": "hello", "parameters": {"stop": "\n"}},
    "stop sequence too long": {"inputs": "hello", "parameters": {"stop": ["x" * 1025]}},
    "negative seed": {"inputs": "hello", "parameters": {"do_sample": True, "seed": -1}},
    "seed 2**64": {"inputs": "hello", "parameters": {"do_sample": True, "seed": 2**64}},
    "best_of 2": {"inputs": "hello", "parameters": {"best_of": 2}},
    "best_of 0": {"inputs": "hello", "parameters": {"best_of": 0}},
    "too many stop sequences": {"inputs": "hello", "parameters": {"stop": ["a", "b", "c", "d", "e"]}},
    "top_n_tokens beyond limit": {"inputs": "hello", "parameters": {"top_n_tokens": 50}},
    "top_n_tokens -1": {"inputs": "hello", "parameters": {"top_n_tokens": -1}},
    "truncate 0": {"inputs": "hello", "parameters": {"truncate": 0}},
    "truncate 2**63": {"inputs": "hello", "parameters": {"truncate": 2**63}},
    "wrong type": {"inputs": "hello", "parameters": {"max_new_tokens": "many"}},
    "priority beyond 32 bits": {"inputs": "hello", "parameters": {"priority": 2**40}},
    "priority below 32 bits": {"inputs": "hello", "parameters": {"priority": -2**31 - 1}},
}

# Accepted, and each must generate: extremes the sampler has to survive (they used to fail the whole batch).
HOSTILE = {
    "temperature 1e-38": {"temperature": 1e-38, "do_sample": True},
    "temperature 1e308": {"temperature": 1e308},
    "top_k 2**40": {"top_k": 2**40},
    "top_k beyond the vocabulary": {"top_k": 49153},
    "top_k 1": {"top_k": 1, "do_sample": True},
    "repetition_penalty 1e-38": {"repetition_penalty": 1e-38, "do_sample": True},
    "repetition_penalty 1e308": {"repetition_penalty": 1e308},
    "repetition_penalty 1e-38 greedy": {"repetition_penalty": 1e-38},
    "top_p 1e-45": {"top_p": 1e-45},
    "typical_p 1e-45": {"typical_p": 1e-45},
    "penalties at their bounds": {"frequency_penalty": -2, "repetition_penalty": 1e-30, "temperature": 1e-5},
}


def hostile_body(name: str) -> dict:
    return {"inputs": "The capital of France is", "parameters": {
        "max_new_tokens": 3, "seed": 1, "details": True, "decoder_input_details": True, "top_n_tokens": 5,
        "stop": ["zz" * 512], **HOSTILE[name]}}


@pytest.mark.parametrize("path", TGI_ROUTES)
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_request_is_422_validation(server, case, path):
    body = assert_error_shape(post(server.url, BAD[case], path), path)
    assert body["error_type"] == "validation"


NAMED = {"temperature NaN": "temperature", "repetition_penalty 'NaN' as a string": "repetition_penalty",
         "stop sequence too long": "1024", "beyond max_total_tokens": "1536", "too many input tokens": "1024",
         "top_k 2.5": "top_k", "best_of 0": "best_of", "truncate 2**63": "truncate",
         "lone surrogate in inputs": "surrogate"}


@pytest.mark.parametrize("case", sorted(NAMED))
def test_error_messages_say_what_is_wrong(server, case):
    r = post(server.url, BAD[case])
    assert NAMED[case] in r.json()["error"], r.json()


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2", "\u00ff".encode("latin-1"), b"[" * 100_000])
@pytest.mark.parametrize("path", TGI_ROUTES + ["/tokenize"])
def test_malformed_json_is_4xx_json(server, raw, path):
    r = post(server.url, raw, path)
    assert 400 <= r.status_code < 500
    assert strict_json(r.text)["error_type"] == "validation"


def assert_generates(r: httpx.Response, path: str) -> list:
    """200 with strict JSON (no NaN or Infinity anywhere); returns the generated tokens."""
    assert r.status_code == 200, f"{path}: {r.status_code} {r.text[:500]}"
    if path == "/generate_stream":
        events = sse_events(r)
        assert events and all("error" not in e for e in events), events
        return [e["token"] for e in events]
    body = strict_json(r.text)
    details = (body[0] if path == "/" else body)["details"]
    assert all(p["logprob"] is None or p["logprob"] <= 0 for p in details["prefill"])
    return details["tokens"]


@pytest.mark.parametrize("path", ["/generate", "/generate_stream"])
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_parameters_generate(server, case, path):
    tokens = assert_generates(post(server.url, hostile_body(case), path), path)
    assert 1 <= len(tokens) <= 3 and all(t["logprob"] <= 0 for t in tokens)


def test_tiny_temperature_is_greedy(server):
    greedy = post(server.url, {"inputs": SHORT[0], "parameters": {"max_new_tokens": 8, "details": True}}).json()
    tiny = post(server.url, {"inputs": SHORT[0], "parameters": {"max_new_tokens": 8, "details": True,
                                                                "temperature": 1e-38, "do_sample": True}}).json()
    assert tiny["details"]["tokens"] == greedy["details"]["tokens"] and tiny["details"]["seed"] is None


def test_masked_alternatives_are_finite_logprobs(server):
    """With top_k 1 every alternative has probability 0: its logprob is -9999.0 (as vLLM), not -Infinity."""
    r = post(server.url, {"inputs": SHORT[0], "parameters": {"max_new_tokens": 3, "top_k": 1, "top_n_tokens": 3,
                                                             "details": True}})
    for top in strict_json(r.text)["details"]["top_tokens"]:
        assert top[0]["logprob"] == pytest.approx(0.0, abs=1e-5) and [t["logprob"] for t in top[1:]] == [-9999.0] * 2


def test_server_keeps_serving_after_bad_input(server):
    for case in BAD.values():
        post(server.url, case)
    ok = post(server.url, {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 4}})
    assert ok.status_code == 200 and ok.json()["generated_text"]
    assert_idle(server.url)


def hostile_requests() -> list[tuple[str, object, bool]]:
    """(path, body, accepted) for every bad and hostile input on every generation route, OpenAI's included."""
    from test_openai import BAD as OPENAI_BAD, HOSTILE as OPENAI_HOSTILE, openai_body
    out = [(path, body, False) for path in TGI_ROUTES for body in BAD.values()]
    out += [(path, hostile_body(name), True) for path in TGI_ROUTES for name in HOSTILE]
    out += [(path, openai_body(route, body), False) for route, body, _ in OPENAI_BAD.values()
            for path in [OPENAI_ROUTES[route == "chat"]]]
    out += [(path, openai_body(route, body), True) for route, body in OPENAI_HOSTILE.values()
            for path in [OPENAI_ROUTES[route == "chat"]]]
    return out


def send_hostile(url: str, path: str, body, accepted: bool) -> None:
    r = post(url, body, path)
    if not accepted:
        assert_error_shape(r, path)
    elif path.startswith("/v1/"):
        assert r.status_code == 200, r.text[:500]
        assert sse_events(r) if body.get("stream") else strict_json(r.text)["choices"]
    else:
        assert_generates(r, path)


def test_hostile_inputs_beside_greedy_requests(server, reference):
    """Greedy requests running while every bad and hostile input arrives finish exactly as transformers'
    `generate` alone (no sampler failure takes their batch down), and the server is idle afterwards."""
    prompts = [reference.tokenizer(p)["input_ids"] for p in SHORT[:4]]
    with ThreadPoolExecutor(8) as pool:
        greedy = [pool.submit(server.generate, ids, max_new_tokens=32, details=True) for ids in prompts]
        hostile = [pool.submit(send_hostile, server.url, *case) for case in hostile_requests()]
        for f in hostile:
            f.result()
        for ids, f in zip(prompts, greedy):
            reference.assert_same_greedy(ids, [t["id"] for t in f.result()["details"]["tokens"]], 32)
    assert_idle(server.url)


@pytest.mark.parametrize("inputs", ["", "a\ud800", 5, [1, 2]])
def test_tokenize_refuses_what_is_not_text(server, inputs):
    body = assert_error_shape(post(server.url, {"inputs": inputs}, "/tokenize"), "/tokenize")
    assert body["error_type"] == "validation"


def test_tokenize_beyond_the_payload_limit_is_413(server):
    r = post(server.url, {"inputs": "x" * 2_100_000}, "/tokenize")
    assert_error_shape(r, "/tokenize", 413)


def test_tokenize_does_not_stall_the_server(server):
    """A text near the payload limit takes seconds to tokenize; /info keeps answering meanwhile."""
    text = ("The quick brown fox jumps over the lazy dog. " * 43_000)[:1_900_000]
    done, latencies, took = threading.Event(), [], []

    def tokenize() -> httpx.Response:
        start = time.monotonic()
        try:
            return post(server.url, {"inputs": text}, "/tokenize", timeout=300)
        finally:
            took.append(time.monotonic() - start)
            done.set()
    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(tokenize)
        time.sleep(0.2)
        while not done.is_set():
            start = time.monotonic()
            assert httpx.get(server.url + "/info", timeout=60).status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.05)
        r = job.result()
    assert r.status_code == 200 and r.json()[-1]["stop"] == len(text)
    assert latencies and max(latencies) < 0.5 * took[0], (latencies, took)
