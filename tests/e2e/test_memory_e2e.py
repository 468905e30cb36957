"""Every memory path in one run on the real model: a pool so small that requests are chunked, offloaded and
restored, soft-reset and resumed, and share prefixes, while greedy output stays equal to transformers'
`generate` on each prompt alone. The router's own counters prove each path ran; nothing leaks."""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import Server, assert_idle, metric

PREFIX = ("A field guide to the birds of the northern coast, chapter one: the gulls, the terns, the puffins "
          "and the cormorants, with notes on where they nest and what they eat. ") * 3
STORIES = [
    "The old lighthouse keeper climbed the stairs every evening and",
    "def merge_sorted(a, b):\n    result = []\n",
    "Three reasons to learn a second language are",
    "The recipe begins with two cups of flour and",
    "In the year 2050, cities will",
    "The committee met on Tuesday to discuss",
]
COUNTERS = ["cb_prefill_chunks_total", "cb_offloads_total", "cb_restores_total", "cb_preemptions_total",
            "cb_prefix_cache_hit_blocks_total"]
SPECULATION = ["cb_speculation_proposed_tokens_total"]


@pytest.fixture(scope="module", params=[0, 4], ids=["plain", "speculate"])
def tiny(request):
    """24 blocks of 16 tokens (384 tokens) for up to eight requests, a swap pool of about eight blocks, and a
    64-token prefill budget: far more demand than room; then the same with speculation's drafts taking room too."""
    s = Server("--num-blocks", "24", "--max-batch-prefill-tokens", "64", "--max-input-tokens", "300",
               "--max-total-tokens", "384", "--max-batch-size", "8", "--cpu-offload-space", "0.0055",
               "--speculate", str(request.param))
    yield s
    s.stop()


def test_tiny_pool_every_memory_path_with_exact_tokens(tiny, reference):
    tok = reference.tokenizer
    info = tiny.info()
    assert info["num_blocks"] == 24 and 4 <= info["num_swap_blocks"] <= 12, info
    before = {name: metric(tiny.url, name) for name in COUNTERS + SPECULATION}

    shared = [tok(PREFIX + q)["input_ids"] for q in ("Which bird dives deepest?", "Where do puffins nest?",
                                                     "What do terns eat?")]
    longs = [tok(STORIES[i] * 12)["input_ids"][:150 + 20 * i] for i in range(2)]
    shorts = [tok(s)["input_ids"] for s in STORIES[2:]]
    first = tiny.generate(shared[0], max_new_tokens=8, details=True)  # names the prefix blocks

    jobs = [(ids, 24) for ids in shared[1:]] + [(ids, 96) for ids in shorts] + [(ids, 40) for ids in longs]
    answers: list = [None] * len(jobs)

    def send(i):
        time.sleep(0.15 * i)  # a fixed arrival order: the long prompts, newest, are evicted first and do not
        # fit the swap pool (soft reset); short ones evicted later do (offload)
        answers[i] = tiny.generate(jobs[i][0], max_new_tokens=jobs[i][1], details=True)

    with ThreadPoolExecutor(len(jobs)) as pool:
        list(pool.map(send, range(len(jobs))))

    ran = {name: metric(tiny.url, name) - before[name] for name in COUNTERS + SPECULATION}
    print(ran)
    assert all(ran[name] > 0 for name in COUNTERS), f"a memory path never ran: {ran}"
    assert (ran["cb_speculation_proposed_tokens_total"] > 0) == (info["speculate"] > 0), ran
    assert ran["cb_restores_total"] == ran["cb_offloads_total"]

    reference.assert_same_greedy(shared[0], [t["id"] for t in first["details"]["tokens"]], 8)
    for (ids, n), answer in zip(jobs, answers):
        assert answer["details"]["finish_reason"] in ("length", "eos_token")
        reference.assert_same_greedy(ids, [t["id"] for t in answer["details"]["tokens"]], n)

    assert_idle(tiny.url)  # every block and swap slot free, nothing offloaded


@pytest.fixture(scope="module")
def one_slot():
    """One running request at a time: who goes next is decided by rank alone, whatever the timing."""
    s = Server("--max-batch-size", "1", "--max-batch-total-tokens", "4096")
    yield s
    s.stop()


def test_priority_request_overtakes_the_queue(one_slot, reference):
    """A long request holds the only slot; three priority-0 requests queue behind it, then a priority -1
    request arrives: it runs next, and finishes before all three."""
    ids = reference.tokenizer(STORIES[0])["input_ids"]
    done: list[str] = []
    lock = threading.Lock()

    def send(name, delay, max_new_tokens, priority=0):
        time.sleep(delay)
        one_slot.generate(ids, max_new_tokens=max_new_tokens, priority=priority)
        with lock:
            done.append(name)

    with ThreadPoolExecutor(5) as pool:
        futures = [pool.submit(send, "long", 0.0, 200)]
        futures += [pool.submit(send, f"normal{i}", 0.3, 10) for i in range(3)]
        futures.append(pool.submit(send, "urgent", 0.6, 10, -1))
        for f in futures:
            f.result()
    assert done[:2] == ["long", "urgent"], f"completion order {done}"
    assert_idle(one_slot.url)
