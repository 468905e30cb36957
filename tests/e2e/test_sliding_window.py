"""A hybrid sliding-window model served end to end: Gemma 3 270M (5 sliding layers with a 512-token window per
full layer), prompts and generations running past the window, chunked, two at a time, with the window layers
in their own small pool whose blocks are recycled as they slide out. Tokens must equal transformers'
`generate` on each prompt alone."""
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import Reference, Server, assert_idle, metric

TEXT = ("The harbour town woke slowly: fishermen hauled nets, the baker opened his shutters, children ran to "
        "school along the sea wall, and the ferry sounded its horn twice before leaving for the islands. ")


@pytest.fixture(scope="module")
def gemma_dir():
    from launcher.model_files import resolve_model
    return resolve_model("gemma3-270m")


@pytest.fixture(scope="module")
def gemma(gemma_dir):
    s = Server("--max-batch-prefill-tokens", "128", "--max-batch-size", "2", "--max-input-tokens", "700",
               "--max-total-tokens", "800", "--max-batch-total-tokens", "4096", model_id="gemma3-270m")
    yield s
    s.stop()


def test_gemma3_beyond_its_window_equals_transformers(gemma, gemma_dir):
    reference = Reference(gemma_dir)
    info = gemma.info()
    window_pool = info["num_window_blocks"]
    # Two requests of 640 tokens hold 80 full-attention blocks; the window pool is smaller, so this only
    # completes if window blocks are recycled as they slide out.
    assert 0 < window_pool < 80 and info["num_swap_blocks"] == 0, info
    ids = reference.tokenizer(TEXT * 20)["input_ids"]
    jobs = [(ids[:600], 40), (ids[:450], 100), (ids[:40], 30)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda j: gemma.generate(j[0], max_new_tokens=j[1], details=True), jobs))
    for (prompt, n), answer in zip(jobs, answers):
        reference.assert_same_greedy(prompt, [t["id"] for t in answer["details"]["tokens"]], n)
    assert_idle(gemma.url)
    assert metric(gemma.url, "cb_window_blocks_free") == metric(gemma.url, "cb_window_blocks_total") == window_pool


def test_gemma3_choices_equal_single_requests(gemma, gemma_dir):
    """n choices of a hybrid model's prompt each compute it (its window layers share nothing), and still equal
    single requests with their seeds."""
    ids = Reference(gemma_dir).tokenizer(TEXT * 3)["input_ids"]
    body = {"prompt": ids, "max_tokens": 10, "temperature": 1.0, "seed": 5, "ignore_eos": True}
    both = httpx.post(f"{gemma.url}/v1/completions", json={**body, "n": 2}, timeout=300).json()
    singles = [httpx.post(f"{gemma.url}/v1/completions", json={**body, "seed": 5 + i}, timeout=300).json()
               for i in range(2)]
    assert [c["text"] for c in both["choices"]] == [s["choices"][0]["text"] for s in singles], both
    assert_idle(gemma.url)
