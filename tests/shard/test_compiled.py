"""Compiled step sizes (shard/compiled.py) on a small random Llama in a shard's Runner: a step a graph compiled at
warmup covers runs it (in float32 on CPU at its own size: one graph for 1 token, one symbolic graph for 2 up to the
largest size), any other runs eagerly, and both give the eager forward's greedy tokens and, to float32 rounding,
its prompt logprobs. A step counts as compiled only when the graph ran (no guard failed)."""
import pytest
import torch

from shard import compile_sizes, linears, paged_kernel
from shard import model as model_lib
from shard.runner import Runner
from shard.sampling import Params
from shard.step import Entry

BS = 4
SIZES = (1, 2, 4)


def runner(path, sizes: tuple[int, ...], dtype: str = "float32") -> Runner:
    r = Runner(model_lib.load(str(path), dtype, torch.device("cpu"), 0, 1), torch.device("cpu"), BS, 0, 1, sizes)
    r.warmup(16)
    if r.compiled:
        assert r.compile()
        r.go_live()
    r.allocate(256)
    return r


@pytest.fixture(scope="module")
def runners(tiny_llama):
    return runner(tiny_llama, ()), runner(tiny_llama, SIZES)


def serve(r: Runner, requests: int, prompt: int, decodes: int, logprobs: bool = True):
    """`requests` prompts of `prompt` tokens in one step (with logprobs: of every prompt token, so every row's
    logits are kept; without: only each prompt's last row), then `decodes` steps of one token each: (prompt
    logprobs, greedy tokens, whether each step ran compiled)."""
    r.clear()
    first = r.step([Entry(i, [(31 * i + 7 * k) % 500 + 3 for k in range(prompt)], list(range(8 * i, 8 * i + 8)),
                          sample=True, params=Params(), prompt_tokens=prompt, prefill_logprobs=logprobs)
                    for i in range(requests)])
    tokens = {g.id: [g.token_id] for g in first.generations}
    ran = [first.compiled]
    for k in range(decodes):
        out = r.step([Entry(i, tokens[i][-1:], [], sample=True, cached_tokens=prompt + k) for i in range(requests)])
        ran.append(out.compiled)
        for g in out.generations:
            tokens[g.id].append(g.token_id)
    return [lp for _, lps in first.prefill for lp in lps[1:]], tokens, ran


def test_every_size_compiles(runners):
    _, compiled = runners
    assert compiled.compiled.ready and compiled.compiled.sizes == SIZES and compiled.compiled.seconds > 0


@pytest.mark.parametrize("requests, prompt, logprobs, expect", [
    (1, 3, True, [True] + [True] * 6),     # a 3-token prompt: the symbolic graph at 3 rows; one decode a step
    (3, 1, True, [True] + [True] * 6),     # three requests a step
    (1, 3, False, [True] + [True] * 6),    # 3 rows, the last one's logits kept (padded to the graph's least, 2)
    (1, 4, False, [True] + [True] * 6),    # a prompt step that keeps fewer rows than it has
    (2, 9, True, [False] + [True] * 6),    # 18 prompt tokens: beyond every size
    (5, 2, True, [False] + [False] * 6),   # five decodes a step: beyond every size
])
def test_compiled_and_eager_steps_give_the_eager_tokens(runners, requests, prompt, logprobs, expect):
    eager, compiled = runners
    want_logprobs, want_tokens, ran_eager = serve(eager, requests, prompt, 6, logprobs)
    logprobs, tokens, ran = serve(compiled, requests, prompt, 6, logprobs)
    assert not any(ran_eager)
    assert ran == expect
    assert tokens == want_tokens
    assert torch.allclose(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-4, rtol=0)


def test_float32_steps_run_at_their_own_size_and_bf16_ones_padded(tiny_llama, runners):
    """oneDNN builds a kernel per shape for bf16, so its steps are padded to bounded sizes; float32's GEMMs (MKL)
    and the symbolic graph build nothing per shape, so padding would only add rows to compute."""
    eager, compiled = runners
    bf16 = Runner(model_lib.load(str(tiny_llama), "bfloat16", torch.device("cpu"), 0, 1), torch.device("cpu"), BS,
                  0, 1, SIZES)
    assert [eager._padded(n) for n in (3, 9, 130)] == [3, 9, 130]
    assert [compiled._padded(n) for n in (3, 9, 130)] == [3, 9, 130]
    assert [bf16._padded(n) for n in (3, 9, 130)] == [4, 16, 144]


def test_bf16_compiles_with_its_linears_and_gives_the_eager_tokens(tiny_llama):
    """bf16 linears on a weight oneDNN packed at load (linears.Packed, where the CPU has bf16 arithmetic) reach
    the graph as an op inductor does not lower; there Warmup times a step of one request compiled and eager and
    keeps the faster (CompiledForward.race_single), and either way the tokens are the eager forward's."""
    packed = linears.packs_bf16()
    if not packed and not paged_kernel.available(torch.device("cpu")):
        pytest.skip("no bf16 arithmetic and no C attention: inductor fuses torch's bf16 attention and rounds otherwise")
    eager, compiled = runner(tiny_llama, (), "bfloat16"), runner(tiny_llama, SIZES, "bfloat16")
    forward = compiled.compiled
    assert forward.ready and bool(forward.timings) == packed
    one_compiled = not packed or forward.timings["compiled"] <= forward.timings["eager"]
    assert forward.sizes == (SIZES if one_compiled else (2, 4))
    for requests, prompt in ((1, 3), (3, 1), (2, 9)):
        _, want, _ = serve(eager, requests, prompt, 4, False)
        _, tokens, ran = serve(compiled, requests, prompt, 4, False)
        assert tokens == want
        assert ran[1:] == [requests > 1 or one_compiled] * 4
    assert compiled._padded(1) == 1


def test_compile_sizes_flag():
    assert compile_sizes.parse("auto", "cpu") == compile_sizes.AUTO["cpu"]
    assert compile_sizes.parse("0", "cuda") == ()
    assert compile_sizes.parse("8, 1,2", "cuda") == (1, 2, 8)
    for bad in ("x", "1,,2", "-4", "2.5"):
        with pytest.raises(ValueError, match="--compile-sizes"):
            compile_sizes.parse(bad, "cpu")
