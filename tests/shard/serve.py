"""Greedy tokens from a shard's Runner in-process: the prompts served together, one decode each per step."""
from shard.runner import Runner
from shard.sampling import Params
from shard.step import Entry

BLOCKS_PER_REQUEST = 16


def greedy(r: Runner, prompts: dict[int, list[int]], n: int) -> dict[int, list[int]]:
    """n tokens for each prompt (request id → prompt ids), request k on blocks [16k, 16k + 16)."""
    per = BLOCKS_PER_REQUEST
    out = {rid: [] for rid in prompts}
    entries = [Entry(rid, p, list(range(k * per, (k + 1) * per)), sample=True, params=Params())
               for k, (rid, p) in enumerate(prompts.items())]
    for step in range(n):
        for g in r.step(entries).generations:
            out[g.id].append(g.token_id)
        entries = [Entry(rid, [out[rid][-1]], [], sample=True, cached_tokens=len(prompts[rid]) + step)
                   for rid in prompts]
    return out
