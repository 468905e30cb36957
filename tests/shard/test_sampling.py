"""The sampler is total: no parameter and no logits row can make it raise (a raise fails the whole batch), and
normal values keep their meaning (greedy is the argmax, a seed gives the same token whatever shares the batch)."""
import itertools
import math

import pytest
import torch

from shard.sampling import GREEDY_BELOW, Params, sample

V = 64
F32_MAX = torch.finfo(torch.float32).max
INF, NAN = float("inf"), float("nan")


def logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def run(row: torch.Tensor, p: Params, history=(1, 2, 3, 1)):
    return sample(row, [p] * row.shape[0], [torch.tensor(history)] * row.shape[0], [7] * row.shape[0])


EXTREME_PARAMS = {
    "temperature": [1e-38, 1e-6, GREEDY_BELOW, 1e30, F32_MAX, INF, NAN, 0.0, -1.0],
    "repetition_penalty": [1e-38, 1e-6, 1e30, F32_MAX, INF, NAN, 0.0, -1.0],
    "frequency_penalty": [-2.0, 2.0, 1e30, INF, -INF, NAN],
    "top_k": [1, V, V + 1, 2**32 - 1, -1],
    "top_p": [1e-38, 1e-45, 0.0, 1.0, NAN, -1.0],
    "typical_p": [1e-38, 0.0, 0.5, NAN, -1.0],
    "top_n_tokens": [1, V, V + 10],
}
CASES = [(field, value, do_sample) for field, values in EXTREME_PARAMS.items() for value in values
         for do_sample in (False, True)]


@pytest.mark.parametrize("field,value,do_sample", CASES, ids=lambda x: repr(x))
def test_extreme_parameter_never_raises(field, value, do_sample):
    p = Params(do_sample=do_sample, seed=3, **{field: value})
    for token, logprob, top in run(logits(2), p):
        assert 0 <= token < V and isinstance(logprob, float) and not math.isnan(logprob)
        assert len(top) == min(p.top_n_tokens, V)


ROWS = {
    "huge": torch.full((V,), F32_MAX),
    "+inf": torch.where(torch.arange(V) == 5, INF, 0.0),
    "nan": torch.where(torch.arange(V) == 5, NAN, 1.0),
    "all nan": torch.full((V,), NAN),
    "all -inf": torch.full((V,), -INF),
    "one possible": torch.where(torch.arange(V) == 9, 0.0, -INF),
}


@pytest.mark.parametrize("name,do_sample,temperature,rp", list(itertools.product(
    sorted(ROWS), [False, True], [1e-5, 1.0, 1e30], [1.0, 1e-38, F32_MAX])))
def test_extreme_logits_never_raise(name, do_sample, temperature, rp):
    p = Params(do_sample=do_sample, temperature=temperature, repetition_penalty=rp, top_k=10, top_p=0.9, seed=1,
               top_n_tokens=3)
    [(token, _, top)] = run(ROWS[name][None].clone(), p)
    assert 0 <= token < V and len(top) == 3
    if name == "one possible":
        assert token == 9
    if name == "+inf":
        assert token == 5


@pytest.mark.parametrize("temperature", [1e-38, 1e-6, NAN])
def test_tiny_temperature_is_greedy(temperature):
    row = logits(3)
    picks = run(row, Params(do_sample=True, temperature=temperature, seed=11))
    assert [t for t, _, _ in picks] == row.argmax(-1).tolist()


def test_nothing_left_to_sample_falls_back_to_the_argmax():
    row = logits(1)
    [(token, logprob, _)] = run(row, Params(do_sample=True, top_p=0.0, seed=5))
    assert token == int(row.argmax()) and logprob == pytest.approx(float(row.log_softmax(-1)[0, token]))


def test_normal_values_unchanged():
    """Greedy is the argmax with its log_softmax; a seeded request draws the same token alone or in a batch, and
    the same as multinomial over the warped distribution with its (seed, position) generator."""
    row = logits(4, seed=1)
    greedy = run(row, Params())
    assert [t for t, _, _ in greedy] == row.argmax(-1).tolist()
    assert greedy[0][1] == pytest.approx(float(row[0].log_softmax(-1).max()))
    p = Params(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, seed=42)
    alone = sample(row[:1], [p], [None], [7])[0]
    mixed = torch.stack([row[1], row[0], row[2], row[0]])
    batched = sample(mixed, [Params(), p, Params(do_sample=True, seed=1), p], [None] * 4, [3, 7, 5, 7])
    assert batched[1] == alone == batched[3]
    warped = row[0] / 0.7
    warped = warped.masked_fill(warped < warped.topk(20).values[-1], -INF)
    probs = warped.softmax(-1)
    order = probs.argsort(descending=True)
    cum = probs[order].cumsum(-1)
    probs[order[cum - probs[order] >= 0.9]] = 0
    gen = torch.Generator().manual_seed((42 * 1_000_003 + 7) % 2**63)
    assert alone[0] == int(torch.multinomial(probs / probs.sum(), 1, generator=gen))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [V, 49152, 1001])  # 1001: a plain-loop tail after the vector lanes
def test_greedy_kernel_equals_the_torch_path(vocab, dtype):
    """A batch of only greedy rows goes through one C pass per row (paged_kernel.greedy): the same tokens as the
    argmax of finite() logits (first index on ties, NaN impossible; bf16 rows, widened, hold many ties) and their
    log_softmax; a row with +inf, or none finite, is left to the torch path, which still answers it."""
    from shard import paged_kernel
    from shard.sampling import finite

    if not paged_kernel.available(torch.device("cpu")):
        pytest.skip("the CPU kernels are off here: CB_PAGED_KERNEL=0, or the shard's warning says why")
    rows = torch.randn(6, vocab, generator=torch.Generator().manual_seed(2)) * 4
    rows[1, 3] = rows[1, vocab - 5] = rows[1].max() + 1  # a tie: the first wins
    rows[2, :7] = NAN
    rows[3, 10:] = -INF
    rows = rows.to(dtype)
    want = finite(rows.float()).argmax(-1)
    tokens, logprobs = paged_kernel.greedy(rows)
    assert tokens == want.tolist()
    assert torch.allclose(torch.tensor(logprobs),
                          finite(rows.float()).log_softmax(-1).gather(1, want[:, None])[:, 0], atol=1e-5, rtol=0)
    for bad in (INF, -INF):
        odd = rows.clone()
        odd[4, 11] = bad
        if bad == -INF:
            odd[4, :] = -INF
        assert paged_kernel.greedy(odd) is None
        assert [t for t, _, _ in sample(odd, [Params()] * 6, [None] * 6, [0] * 6)][:4] == tokens[:4]


def mask_of(allowed: list[int], vocab: int = V) -> bytes:
    words = [0] * ((vocab + 31) // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return b"".join(w.to_bytes(4, "little") for w in words)


@pytest.mark.parametrize("do_sample", [False, True])
def test_a_mask_keeps_only_its_tokens(do_sample):
    """Constrained rows sample only allowed tokens (greedy: the best allowed one), whatever else is likely; an
    unmasked row beside them is untouched; a mask shorter than the vocabulary allows nothing past its end."""
    from shard.sampling import constrain
    rows = logits(3, seed=5)
    allowed = [3, 40, 63]
    short = mask_of([1, 2], vocab=32)[:4]
    masked = constrain(rows.clone(), [mask_of(allowed), b"", short])
    assert torch.equal(masked[1], rows[1])
    assert masked[2, 32:].isneginf().all() and masked[2, [1, 2]].isfinite().all()
    for seed in range(20):
        (token, logprob, _), _, (other, _, _) = run(masked, Params(do_sample=do_sample, seed=seed))
        assert token in allowed and other in (1, 2) and math.isfinite(logprob)
        if not do_sample:
            assert token == max(allowed, key=lambda t: rows[0, t])


@pytest.mark.parametrize("draft", [0, 3, 7])
def test_verified_drafts_leave_the_sampled_distribution_unchanged(draft):
    """Speculation's rejection rule: whatever the draft (the most likely token, a middling one, an unlikely one),
    the first token verify() produces is distributed as sample() draws it; greedy verification is the argmax."""
    from shard.sampling import verify
    row = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])
    p = Params(do_sample=True, temperature=1.0)
    expected = row[0].softmax(-1)
    draws = 6000
    counts = torch.zeros(8)
    for seed in range(draws):
        p.seed = seed
        counts[verify(row.repeat(2, 1), [draft], p, 5)[0][0]] += 1
    sigma = (expected * (1 - expected) / draws).sqrt()
    assert ((counts / draws - expected).abs() <= 5 * sigma + 1e-3).all(), (counts / draws, expected)
    greedy = verify(torch.stack([row[0], row[0].flip(0)]), [0], Params(), 5)
    assert [t for t, _ in greedy] == [0, 7]  # the draft is the argmax: accepted, then the next row's argmax
