"""Many choices of one prompt (OpenAI's n and best_of, TGI's best_of) on the shared server: choice i equals a
single request with seed + i, the prompt is computed once (the other choices find its full blocks in the prefix
cache: a metric shows it), streams carry each choice's index, and best_of keeps the most likely."""
import json

import httpx
import pytest
from text_generation import Client

from conftest import assert_idle, metric
from test_api_errors import post

PROMPT = "Write a short poem about the sea. " * 6  # ~42 tokens: full blocks and a partial one


def test_n_choices_equal_single_requests_with_their_seeds_and_share_the_prompt(server, client, reference):
    n_prompt, bs = len(reference.tokenizer(PROMPT)["input_ids"]), server.info()["block_size"]
    full = (n_prompt - 1) // bs * bs  # the blocks a lookup may find (the last token is always computed)
    hits = metric(server.url, "cb_prefix_cache_hit_tokens_total")
    r = client.completions.create(model="cb", prompt=PROMPT, max_tokens=12, n=4, seed=100, temperature=1.0,
                                  extra_body={"ignore_eos": True})
    shared = metric(server.url, "cb_prefix_cache_hit_tokens_total") - hits
    assert shared == 3 * full, (shared, full)  # choices 1-3 recomputed only the prompt's partial last block
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == 4 * 12
    singles = [client.completions.create(model="cb", prompt=PROMPT, max_tokens=12, seed=100 + i, temperature=1.0,
                                         extra_body={"ignore_eos": True}).choices[0].text for i in range(4)]
    assert [c.text for c in r.choices] == singles
    assert len(set(singles)) > 1
    assert_idle(server.url)


def test_streamed_choices_carry_their_index_and_reassemble(client):
    kw = dict(model="cb", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=10, n=3, seed=7,
              temperature=1.0)
    whole = client.chat.completions.create(**kw)
    texts, finishes = ["", "", ""], [None] * 3
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finishes[c.index] = c.finish_reason or finishes[c.index]
    assert texts == [c.message.content for c in whole.choices]
    assert finishes == [c.finish_reason for c in whole.choices]


def test_openai_best_of_returns_the_most_likely(client):
    kw = dict(model="cb", prompt="The best fruit is", max_tokens=8, temperature=1.0, seed=11, logprobs=0)
    singles = [client.completions.create(**{**kw, "seed": 11 + i}).choices[0] for i in range(3)]
    best = client.completions.create(best_of=3, **kw).choices
    assert len(best) == 1
    assert best[0].text == max(singles, key=lambda c: sum(c.logprobs.token_logprobs)).text


def test_tgi_best_of_lists_the_other_sequences(server):
    body = {"inputs": "The best fruit is", "parameters": {"max_new_tokens": 8, "do_sample": True, "seed": 5,
                                                           "best_of": 3, "details": True}}
    out = post(server.url, body).json()
    others = out["details"]["best_of_sequences"]
    assert len(others) == 2 and {o["seed"] for o in others} | {out["details"]["seed"]} == {5, 6, 7}
    total = lambda d: sum(t["logprob"] for t in d["tokens"])  # noqa: E731
    assert all(total(out["details"]) >= total(o) for o in others)
    single = post(server.url, {"inputs": "The best fruit is", "parameters": {
        "max_new_tokens": 8, "do_sample": True, "seed": out["details"]["seed"]}}).json()
    assert single["generated_text"] == out["generated_text"]
    via_client = Client(server.url, timeout=300).generate("The best fruit is", max_new_tokens=8, do_sample=True,
                                                          best_of=3)  # the client refuses a seed with best_of
    assert len(via_client.details.best_of_sequences) == 2
    streamed = httpx.post(server.url + "/generate_stream", json=body, timeout=60)
    assert streamed.status_code == 422 and "best_of" in json.loads(streamed.text)["error"]
    greedy = post(server.url, {"inputs": "x", "parameters": {"best_of": 2}})
    assert greedy.status_code == 422 and "sampling" in greedy.json()["error"]
