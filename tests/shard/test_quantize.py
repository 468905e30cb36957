"""--quantize int8 on a shard's Runner in-process (a small random Llama): the weights really are int8, the logits
stay close to the unquantized model's, and a request's greedy tokens do not depend on what shares its batch."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from shard import model as model_lib
from shard.quantize import Int8Linear
from shard.runner import Runner
from shard.sampling import Params
from shard.step import Entry

BS = 4


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    torch.manual_seed(7)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.1)
    path = tmp_path_factory.mktemp("tiny-llama-q")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def runner(path, quantize=None) -> Runner:
    loaded = model_lib.load(str(path), "bfloat16", torch.device("cpu"), 0, 1, quantize)
    r = Runner(loaded, torch.device("cpu"), BS, 0, 1)
    r.allocate(256)
    return r


def greedy(r: Runner, prompts: dict[int, list[int]], n: int) -> dict[int, list[int]]:
    """Serves the prompts together (one batch, one decode per step), n tokens each."""
    per = 16
    out = {rid: [] for rid in prompts}
    entries = [Entry(rid, p, list(range(k * per, (k + 1) * per)), sample=True, params=Params())
               for k, (rid, p) in enumerate(prompts.items())]
    for step in range(n):
        for g in r.step(entries).generations:
            out[g.id].append(g.token_id)
        entries = [Entry(rid, [out[rid][-1]], [], sample=True, cached_tokens=len(prompts[rid]) + step)
                   for rid in prompts]
    return out


def test_int8_weights_logits_close_and_batch_invariant(tiny_llama):
    plain, quant = runner(tiny_llama), runner(tiny_llama, "int8")
    linears = [m for m in quant.loaded.model.modules() if isinstance(m, Int8Linear)]
    assert len(linears) == 3 * 7 + 1 and all(m.weight.dtype == torch.int8 for m in linears)
    prompt = list(range(10, 40))
    scored = [torch.tensor(r.step([Entry(9, prompt, list(range(8)), params=Params(), prompt_tokens=len(prompt),
                                         prefill_logprobs=True)]).prefill[0][1][1:]) for r in (plain, quant)]
    assert (scored[0] - scored[1]).abs().max() < 0.1, "the prompt's logprobs barely move"
    plain.clear()
    quant.clear()
    gen = torch.Generator().manual_seed(3)
    others = {rid: torch.randint(5, 500, (11 + rid,), generator=gen).tolist() for rid in range(2, 6)}
    alone = greedy(quant, {1: prompt}, 12)[1]
    quant.clear()
    together = greedy(quant, {1: prompt, **others}, 12)[1]
    assert alone == together
