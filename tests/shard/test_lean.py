"""The lean Llama forward (shard/lean.py) against transformers' own modules on the same paged attention (a small
random Llama, a shard's Runner in-process): the same prompt logprobs and the same greedy tokens, to the bit, in
float32 and bfloat16; other families keep transformers' modules."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from shard import lean
from shard import model as model_lib
from shard.runner import Runner
from shard.sampling import Params
from shard.step import Entry

BS = 4


def runner(path, dtype: str, monkeypatch, use_lean: bool) -> Runner:
    with monkeypatch.context() as patch:
        if not use_lean:
            patch.setattr(lean, "supports", lambda model: False)
        loaded = model_lib.load(str(path), dtype, torch.device("cpu"), 0, 1)
    assert isinstance(loaded.model, lean.LeanLlama) == use_lean
    r = Runner(loaded, torch.device("cpu"), BS, 0, 1)
    r.allocate(128)
    return r


def run(r: Runner) -> tuple[list[float], list[int]]:
    """A 37-token prompt in two chunks with its logprobs, then 10 greedy decodes beside a second request."""
    prompt, other = list(range(20, 57)), list(range(300, 309))
    first = r.step([Entry(1, prompt[:24], list(range(12)), params=Params(), prompt_tokens=37, prefill_logprobs=True),
                    Entry(2, other, list(range(12, 20)), sample=True, params=Params())])
    rest = r.step([Entry(1, prompt[24:], [], sample=True, cached_tokens=24)])
    logprobs = first.prefill[0][1][1:] + rest.prefill[0][1]
    tokens = {1: [rest.generations[0].token_id], 2: [first.generations[0].token_id]}
    cached = {1: 37, 2: 9}
    for _ in range(10):
        out = r.step([Entry(i, tokens[i][-1:], [], sample=True, cached_tokens=cached[i]) for i in (1, 2)])
        for g in out.generations:
            tokens[g.id].append(g.token_id)
            cached[g.id] += 1
    return logprobs, tokens[1] + tokens[2]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lean_llama_equals_transformers_modules(tiny_llama, dtype, monkeypatch):
    lean_out = run(runner(tiny_llama, dtype, monkeypatch, True))
    modules_out = run(runner(tiny_llama, dtype, monkeypatch, False))
    assert len(lean_out[0]) == 36 and len(lean_out[1]) == 22
    assert lean_out == modules_out


def test_only_plain_llama_configs_take_the_lean_path():
    assert lean.supports(LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=64,
                                                      num_attention_heads=2, vocab_size=64)))
    assert not lean.supports(LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=64,
                                                          num_attention_heads=2, vocab_size=64, attention_bias=True)))
