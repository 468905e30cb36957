"""Prompt-lookup speculation (--speculate 4) on a real server: a request asked to repeat a passage drafts from
it and most drafts are accepted (the metrics show it), yet greedy tokens equal transformers' generate, alone and
beside other requests, through chunked prompts and prefix reuse; seeded sampling is reproducible; stop
sequences still end the text where they occur. (TP=3 and offload with speculation: test_faults.py and
test_memory_e2e.py run their servers with it too.)"""
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import Server, assert_idle, metric
from test_correctness import prompts

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great lamp, and "
           "wrote the weather in a leather book: wind from the west, a grey sea, three ships passing north. ")


@pytest.fixture(scope="module")
def spec():
    s = Server("--speculate", "4", "--max-batch-prefill-tokens", "64", "--max-batch-total-tokens", "8192",
               "--max-input-tokens", "1024", "--max-total-tokens", "1536")
    yield s
    assert s.stop() == 0, s.logs()


def grounded(tokenizer) -> list[int]:
    return tokenizer(f"Copy this text exactly.\n\n{PASSAGE}\n\nCopy:\n{PASSAGE[:60]}")["input_ids"]


def test_grounded_greedy_equals_transformers_with_most_drafts_accepted(spec, reference):
    ids = grounded(reference.tokenizer)
    proposed = metric(spec.url, "cb_speculation_proposed_tokens_total")
    accepted = metric(spec.url, "cb_speculation_accepted_tokens_total")
    out = spec.generate(ids, max_new_tokens=48, details=True)
    reference.assert_same_greedy(ids, [t["id"] for t in out["details"]["tokens"]], 48)
    proposed = metric(spec.url, "cb_speculation_proposed_tokens_total") - proposed
    accepted = metric(spec.url, "cb_speculation_accepted_tokens_total") - accepted
    assert proposed > 0 and accepted / proposed > 0.5, (proposed, accepted)
    again = spec.generate(ids, max_new_tokens=48, details=True)  # prefix reuse
    assert again["details"]["tokens"] == out["details"]["tokens"]


def test_concurrent_chunked_greedy_equals_transformers(spec, reference):
    all_ids = prompts(reference.tokenizer)[::3] + [grounded(reference.tokenizer)]
    with ThreadPoolExecutor(len(all_ids)) as pool:
        answers = list(pool.map(lambda ids: spec.generate(ids, max_new_tokens=20, details=True), all_ids))
    for ids, answer in zip(all_ids, answers):
        reference.assert_same_greedy(ids, [t["id"] for t in answer["details"]["tokens"]], 20)
    assert_idle(spec.url)


def test_seeded_sampling_is_reproducible_and_stops_hold(spec, reference):
    ids = grounded(reference.tokenizer)
    runs = [spec.generate(ids, max_new_tokens=40, do_sample=True, temperature=0.7, seed=3)["generated_text"]
            for _ in range(2)]
    assert runs[0] == runs[1]
    full = spec.generate(ids, max_new_tokens=40)["generated_text"]
    stop = full[20:26]
    cut = spec.generate(ids, max_new_tokens=40, stop=[stop], details=True)
    assert cut["details"]["finish_reason"] == "stop_sequence"
    end = full.index(stop) + len(stop)
    assert full.startswith(cut["generated_text"]) and len(cut["generated_text"]) >= end  # ends in the stop's token
