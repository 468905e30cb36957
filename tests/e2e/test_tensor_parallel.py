"""Tensor parallelism: the same tokens as one shard and as transformers' generate, on a small model built from a
config (4 heads, 2 KV heads) over 2 shards. SmolLM2 over 3 shards is test_faults.py's server.
"""
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import Reference, Server
from test_correctness import SHORT, prompts


def serve_all(server: Server, all_ids, max_new_tokens: int) -> list[list[int]]:
    with ThreadPoolExecutor(len(all_ids)) as pool:
        answers = pool.map(lambda ids: server.generate(ids, max_new_tokens=max_new_tokens, details=True), all_ids)
        return [[t["id"] for t in a["details"]["tokens"]] for a in answers]


@pytest.fixture(scope="module")
def tiny_model_dir(model_dir, tmp_path_factory):
    """A 4-layer Llama with 4 heads and 2 KV heads, random weights, SmolLM2's tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(1234)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      initializer_range=0.1, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


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
