"""Tensor parallelism: the same tokens as one shard and as transformers' generate, on a small model built from a
config (4 heads, 2 KV heads) over 2 shards. SmolLM2 over 3 shards is test_faults.py's server.
"""
from concurrent.futures import ThreadPoolExecutor

from conftest import Reference, Server
from test_correctness import SHORT, prompts


def serve_all(server: Server, all_ids, max_new_tokens: int) -> list[list[int]]:
    with ThreadPoolExecutor(len(all_ids)) as pool:
        answers = pool.map(lambda ids: server.generate(ids, max_new_tokens=max_new_tokens, details=True), all_ids)
        return [[t["id"] for t in a["details"]["tokens"]] for a in answers]


def test_two_shards_equal_one_shard(tiny_model_dir):
    ref = Reference(tiny_model_dir)
    all_ids = [ref.tokenizer(p)["input_ids"] for p in SHORT] + prompts(ref.tokenizer)[10:12]
    results = []
    for shards in ("1", "2"):
        s = Server("--num-shard", shards, "--max-batch-prefill-tokens", "64", "--max-batch-total-tokens", "4096",
                   "--max-total-tokens", "1024", model_id=str(tiny_model_dir))
        try:
            results.append(serve_all(s, all_ids, 16))
        finally:
            assert s.stop() == 0
    one, two = results
    assert one == two
    for ids, ours in zip(all_ids, two):
        ref.assert_same_greedy(ids, ours, 16)
