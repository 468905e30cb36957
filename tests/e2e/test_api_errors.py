"""Bad input gets TGI's error shape and status, and nothing else is disturbed."""
import httpx
import pytest

from conftest import assert_idle


def post(url: str, body, path: str = "/generate", **kw) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(url + path, content=body, headers={"Content-Type": "application/json"}, timeout=60, **kw)
    return httpx.post(url + path, json=body, timeout=60, **kw)


BAD = {
    "empty inputs": {"inputs": "", "parameters": {"max_new_tokens": 5}},
    "empty token ids": {"inputs": [], "parameters": {"max_new_tokens": 5}},
    "too many input tokens": {"inputs": "hello " * 1500, "parameters": {"max_new_tokens": 5}},
    "max_new_tokens 0": {"inputs": "hello", "parameters": {"max_new_tokens": 0}},
    "beyond max_total_tokens": {"inputs": "hello", "parameters": {"max_new_tokens": 5000}},
    "negative temperature": {"inputs": "hello", "parameters": {"temperature": -1.0}},
    "top_p above 1": {"inputs": "hello", "parameters": {"top_p": 1.5}},
    "token id out of vocabulary": {"inputs": [1, 99999999], "parameters": {"max_new_tokens": 5}},
    "missing inputs": {"parameters": {"max_new_tokens": 5}},
    "empty stop sequence": {"inputs": "hello", "parameters": {"stop": [""]}},
    "negative seed": {"inputs": "hello", "parameters": {"do_sample": True, "seed": -1}},
    "best_of 2": {"inputs": "hello", "parameters": {"best_of": 2}},
    "too many stop sequences": {"inputs": "hello", "parameters": {"stop": ["a", "b", "c", "d", "e"]}},
    "top_n_tokens beyond limit": {"inputs": "hello", "parameters": {"top_n_tokens": 50}},
    "wrong type": {"inputs": "hello", "parameters": {"max_new_tokens": "many"}},
    "priority beyond 32 bits": {"inputs": "hello", "parameters": {"priority": 2**40}},
}


@pytest.mark.parametrize("path", ["/generate", "/generate_stream"])
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_request_is_422_validation(server, case, path):
    r = post(server.url, BAD[case], path)
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["error_type"] == "validation" and body["error"]


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2", "\u00ff".encode("latin-1")])
def test_malformed_json_is_4xx_json(server, raw):
    r = post(server.url, raw)
    assert 400 <= r.status_code < 500
    assert r.json()["error_type"] == "validation"


def test_server_keeps_serving_after_bad_input(server):
    for case in BAD.values():
        post(server.url, case)
    ok = post(server.url, {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 4}})
    assert ok.status_code == 200 and ok.json()["generated_text"]
    assert_idle(server.url)


def test_error_messages_say_what_is_wrong(server):
    r = post(server.url, BAD["beyond max_total_tokens"])
    assert "max_new_tokens" in r.json()["error"] and "1536" in r.json()["error"]
    r = post(server.url, BAD["too many input tokens"])
    assert "1024" in r.json()["error"]
