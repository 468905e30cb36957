"""A tiny random Llama saved once per session, for the tests that load a shard's model in-process."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """3 layers, 4 query heads over 2 KV heads, vocabulary 512."""
    torch.manual_seed(7)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.1)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path
