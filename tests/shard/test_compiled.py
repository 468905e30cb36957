"""Compiled step sizes (shard/compiled.py) on a small random Llama in a shard's Runner: a step whose padded size is
a compiled one runs the graph compiled at warmup, any other runs eagerly, and both give the eager forward's
greedy tokens and, to float32 rounding, its prompt logprobs."""
import pytest
import torch

from shard import compile_sizes
from shard import model as model_lib
from shard.runner import Runner
from shard.sampling import Params
from shard.step import Entry

BS = 4
SIZES = (1, 2, 4)


def runner(path, sizes: tuple[int, ...]) -> Runner:
    r = Runner(model_lib.load(str(path), "float32", torch.device("cpu"), 0, 1), torch.device("cpu"), BS, 0, 1, sizes)
    r.warmup(16)
    r.allocate(256)
    return r


@pytest.fixture(scope="module")
def runners(tiny_llama):
    return runner(tiny_llama, ()), runner(tiny_llama, SIZES)


def serve(r: Runner, requests: int, prompt: int, decodes: int):
    """`requests` prompts of `prompt` tokens in one step (logprobs of every prompt token), then `decodes` steps of
    one token each: (prompt logprobs, greedy tokens, whether each step ran compiled)."""
    r.clear()
    first = r.step([Entry(i, [(31 * i + 7 * k) % 500 + 3 for k in range(prompt)], list(range(8 * i, 8 * i + 8)),
                          sample=True, params=Params(), prompt_tokens=prompt, prefill_logprobs=True)
                    for i in range(requests)])
    tokens = {g.id: [g.token_id] for g in first.generations}
    ran = [first.compiled]
    for k in range(decodes):
        out = r.step([Entry(i, tokens[i][-1:], [], sample=True, cached_tokens=prompt + k) for i in range(requests)])
        ran.append(out.compiled)
        for g in out.generations:
            tokens[g.id].append(g.token_id)
    return [lp for _, lps in first.prefill for lp in lps[1:]], tokens, ran


def test_warmup_compiles_every_size(runners):
    _, compiled = runners
    assert compiled.compiled.ready and compiled.compiled.sizes == SIZES and compiled.compiled.seconds > 0


@pytest.mark.parametrize("requests, prompt, expect", [
    (1, 3, [True] + [True] * 6),     # a 3-token prompt is padded to 4; one decode a step
    (3, 1, [True] + [True] * 6),     # three requests a step, padded to 4
    (2, 9, [False] + [True] * 6),    # 18 prompt tokens: beyond every size
    (5, 2, [False] + [False] * 6),   # five decodes a step: beyond every size
])
def test_compiled_and_eager_steps_give_the_eager_tokens(runners, requests, prompt, expect):
    eager, compiled = runners
    want_logprobs, want_tokens, ran_eager = serve(eager, requests, prompt, 6)
    logprobs, tokens, ran = serve(compiled, requests, prompt, 6)
    assert not any(ran_eager)
    assert ran == expect
    assert tokens == want_tokens
    assert torch.allclose(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-4, rtol=0)


def test_compile_sizes_flag():
    assert compile_sizes.parse("auto", "cpu") == compile_sizes.AUTO["cpu"]
    assert compile_sizes.parse("0", "cuda") == ()
    assert compile_sizes.parse("8, 1,2", "cuda") == (1, 2, 8)
    for bad in ("x", "1,,2", "-4", "2.5"):
        with pytest.raises(ValueError, match="--compile-sizes"):
            compile_sizes.parse(bad, "cpu")
