"""Steps timed at Warmup, so that the router's cost model (router/core/pacing.py) starts from this machine's own
step times instead of learning them during the first burst: decode-only steps of one, some and many requests, and
prompt chunks beside decodes, small, large and late in a prompt.

The requests are made up on a scratch pool: each decode is a first step of one token after CONTEXT cached tokens,
each chunk a first step after its start, so nothing needs prefilling first; the keys they read are the pool's
zeros, which cost what real keys cost. Each shape runs twice and the faster is kept: the first builds what a new
shape needs (oneDNN's kernels for bf16), which a server pays once.
"""
import time

from shard.kv_cache import ceil_div
from shard.runner import Runner
from shard.sampling import Params
from shard.step import Entry

CONTEXT = 128  # tokens each timed decode has cached (W64's prompts average 141)
BESIDE = 16    # decodes beside the timed prompt chunks


def plan(max_prefill_tokens: int, max_batch_size: int) -> list[tuple[int, int, int]]:
    """(decodes, chunk start, chunk tokens) of each timed step."""
    many, some = min(64, max_batch_size), min(BESIDE, max_batch_size)
    small, large = min(64, max_prefill_tokens), max_prefill_tokens
    decode_only = [(d, 0, 0) for d in sorted({1, some, many})]
    return list(dict.fromkeys(decode_only + [(some, 0, small), (some, 0, large), (some, large, small)]))


def time_steps(runner: Runner, max_prefill_tokens: int, max_batch_size: int) -> list[tuple[int, int, int, float]]:
    """(decodes, chunk start, chunk tokens, seconds) of each step of `plan`, run on a scratch pool."""
    steps = plan(max_prefill_tokens, max_batch_size)
    bs = runner.block_size
    per_decode = ceil_div(CONTEXT + 1, bs)
    needed = max(d * per_decode + ceil_div(start + n, bs) for d, start, n in steps)
    scratch = runner.scratch(needed)
    windowed = scratch.cache.window is not None
    timed = []
    for decodes, start, n in steps:
        next_block = 0

        def entry(i: int, tokens: int, cached: int) -> Entry:
            nonlocal next_block
            blocks = list(range(next_block, next_block + ceil_div(cached + tokens, bs)))
            next_block += len(blocks)
            return Entry(i, [1] * tokens, blocks, sample=True, cached_tokens=cached, params=Params(),
                         new_window_blocks=blocks if windowed else [])
        entries = [entry(i, 1, CONTEXT) for i in range(decodes)]
        if n:
            entries.append(entry(decodes, n, start))
        seconds = []
        for _ in range(2):
            scratch.clear()
            began = time.perf_counter()
            scratch.step(entries)
            seconds.append(time.perf_counter() - began)
        timed.append((decodes, start, n, min(seconds)))
    scratch.cache = None
    return timed
