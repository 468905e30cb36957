"""The central property: greedy output through launcher → router → shards under continuous batching equals
transformers' own `generate` on each prompt alone."""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from conftest import stream_events

SHORT = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a haiku about the sea.",
    "List three primary colors:",
    "In 1969, the first person to walk on the moon was",
    "import numpy as np\n",
    "Translate to French: good morning",
    "The quick brown fox",
    "Q: What is 12 times 12?\nA:",
    "Photosynthesis is the process by which",
]
LONG_SEED = [
    "The history of the Roman Empire spans many centuries, from the founding of the city to the fall of the west. ",
    "Machine learning systems learn patterns from data; a serving system must batch requests efficiently. ",
    "Once upon a time, in a quiet village by the mountains, there lived an old clockmaker and his cat. ",
    "Rust and Python take different approaches to memory safety, performance and developer ergonomics. ",
    "The ocean covers most of the planet and holds a large share of its living species and water. ",
    "A recipe for bread: flour, water, salt and yeast, mixed, kneaded, proofed and baked until golden. ",
]


def prompts(tokenizer) -> list[list[int]]:
    """Ten short prompts and six of 100-300 tokens (beyond the server's 64-token prefill budget)."""
    out = [tokenizer(p)["input_ids"] for p in SHORT]
    for i, seed in enumerate(LONG_SEED):
        ids = tokenizer(seed * 8)["input_ids"]
        out.append(ids[: 100 + 40 * i])
    return out


def test_concurrent_greedy_equals_transformers(server, reference):
    all_ids = prompts(reference.tokenizer)
    assert len(all_ids) >= 16 and sum(len(p) > 64 for p in all_ids) >= 6
    new = [16 + (i % 4) * 8 for i in range(len(all_ids))]
    with ThreadPoolExecutor(len(all_ids)) as pool:
        answers = list(pool.map(lambda a: server.generate(a[0], max_new_tokens=a[1], details=True),
                                zip(all_ids, new)))
    for ids, n, answer in zip(all_ids, new, answers):
        ours = [t["id"] for t in answer["details"]["tokens"]]
        reference.assert_same_greedy(ids, ours, n)
        assert answer["generated_text"] == reference.tokenizer.decode(ours, skip_special_tokens=True)


def test_text_prompt_matches_token_prompt(server, reference):
    text = SHORT[0]
    by_text = server.generate(text, max_new_tokens=12, details=True)
    by_ids = server.generate(reference.tokenizer(text)["input_ids"], max_new_tokens=12, details=True)
    assert by_text["details"]["tokens"] == by_ids["details"]["tokens"]
    reference.assert_same_greedy(reference.tokenizer(text)["input_ids"],
                                 [t["id"] for t in by_text["details"]["tokens"]], 12)


def test_stream_equals_non_stream(server):
    events = list(stream_events(server.url, SHORT[1], max_new_tokens=20))
    whole = server.generate(SHORT[1], max_new_tokens=20, details=True)
    assert [e["token"]["id"] for e in events] == [t["id"] for t in whole["details"]["tokens"]]
    assert events[-1]["generated_text"] == whole["generated_text"]
    assert events[-1]["details"]["finish_reason"] == "length"
    assert all(e["generated_text"] is None for e in events[:-1])


def test_late_short_request_joins_running_batch(server):
    """A short request sent while a long one decodes finishes first: it joined the running batch."""
    finished = {}
    long_started = threading.Event()

    def long_request():
        for i, _ in enumerate(stream_events(server.url, SHORT[2], max_new_tokens=120, ignore_eos=True)):
            long_started.set()
        finished["long"] = time.monotonic()

    t = threading.Thread(target=long_request)
    t.start()
    assert long_started.wait(300)
    server.generate(SHORT[3], max_new_tokens=4)
    finished["short"] = time.monotonic()
    t.join()
    assert finished["short"] < finished["long"]


def test_ignore_eos_forces_length(server):
    answer = server.generate(SHORT[0], max_new_tokens=40, ignore_eos=True, details=True)
    assert answer["details"]["generated_tokens"] == 40
    assert answer["details"]["finish_reason"] == "length"


def test_seeded_sampling_is_reproducible(server):
    a = server.generate(SHORT[7], max_new_tokens=16, do_sample=True, seed=7, temperature=0.9, details=True)
    b = server.generate(SHORT[7], max_new_tokens=16, do_sample=True, seed=7, temperature=0.9, details=True)
    c = server.generate(SHORT[7], max_new_tokens=16, do_sample=True, seed=8, temperature=0.9, details=True)
    assert a["generated_text"] == b["generated_text"]
    assert a["details"]["seed"] == 7
    assert a["generated_text"] != c["generated_text"]
