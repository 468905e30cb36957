"""The decode attention kernel (shard/kernels/paged_decode.c) reads the cache in place through the block tables;
it must give what the torch path (gather the blocks, batched matmuls, float32 softmax) gives, and a Runner
using it must serve the same greedy tokens."""
import pytest
import torch

from shard import attention, paged_kernel
from shard.model import load
from shard.runner import Runner

from serve import greedy

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def kernels():
    if not paged_kernel.available(CPU):
        pytest.skip("the CPU kernels are off here: CB_PAGED_KERNEL=0, or the shard's warning says why")


def _torch_path(q, rows, kc, vc, tables, key_start, kv_len, window, scale):
    hkv, _, bs, dim = kc.shape
    b, width = tables.shape
    kg = kc[:, tables.reshape(-1)].reshape(hkv, b, width * bs, dim)
    vg = vc[:, tables.reshape(-1)].reshape(hkv, b, width * bs, dim)
    keys = key_start[:, None] + torch.arange(width * bs)
    visible = keys < kv_len[:, None]
    if window:
        visible &= keys > kv_len[:, None] - 1 - window
    qd = q.reshape(hkv, q.shape[0] // hkv, q.shape[1], dim)[:, :, rows]
    return attention._decodes(qd, kg, vg, visible[:, None], scale)  # [Hkv, G, B, D]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("hkv, group, dim, window, key_start", [(3, 3, 64, None, 0), (2, 4, 32, 40, 0),
                                                                 (1, 8, 256, 100, 48), (4, 1, 16, None, 0),
                                                                 (2, 2, 40, 30, 5)])  # not 16 lanes: plain loops
@pytest.mark.parametrize("bs", [16, 32])  # 32: more than sixteen keys a block
def test_kernel_equals_gather_and_matmul(dtype, tol, hkv, group, dim, window, key_start, bs):
    torch.manual_seed(0)
    batch, width = 7, 320 // bs
    kc = torch.randn(hkv, batch * width + 3, bs, dim).to(dtype)
    vc = torch.randn(hkv, batch * width + 3, bs, dim).to(dtype)
    tables = torch.randperm(batch * width + 3)[:batch * width].view(batch, width)
    starts = torch.full((batch,), key_start)
    kv_len = starts + torch.tensor([1, 2, 17, 100, 150, 250, width * bs])[:batch]
    tokens = batch + 5
    q = torch.randn(tokens, hkv * group, dim).to(dtype).transpose(0, 1)  # [H, T, D], strided as the layers give it
    rows = torch.tensor([0, 2, 3, 4, 8, 9, 11])
    out = torch.full((tokens, hkv * group, dim), 7.0, dtype=dtype).transpose(0, 1)
    assert paged_kernel.decode(q, rows, kc, vc, tables, starts, kv_len, window, out, dim ** -0.5)
    ref = _torch_path(q, rows, kc, vc, tables, starts, kv_len, window, dim ** -0.5)
    got = out.reshape(hkv, group, tokens, dim)[:, :, rows]
    assert (got.float() - ref.float()).abs().max() < tol
    others = [t for t in range(tokens) if t not in rows.tolist()]
    assert (out[:, others] == 7.0).all(), "rows of no request are left alone"


def test_shapes_beyond_the_kernel_are_declined():
    kc = torch.zeros(1, 2, 16, 8)
    one = torch.zeros(1, dtype=torch.long)
    assert not paged_kernel.decode(torch.zeros(17, 1, 8), one, kc, kc, torch.zeros(1, 1, dtype=torch.long), one,
                                   one + 1, None, torch.zeros(17, 1, 8), 1.0), "17 query heads per KV head"


def test_runner_with_the_kernel_serves_the_same_tokens(tiny_llama, monkeypatch):
    loaded = load(str(tiny_llama), "float32", CPU, 0, 1)
    prompts = {i: [(5 + 11 * i + 3 * k) % 500 for k in range(9 + 23 * i)] for i in range(5)}
    outs = []
    calls = []
    decode = paged_kernel.decode
    monkeypatch.setattr(paged_kernel, "decode", lambda *a: calls.append(1) or decode(*a))
    for kernel in (True, False):
        r = Runner(loaded, CPU, 16, 0, 1)
        assert r.kernel
        r.kernel = kernel
        r.allocate(128)
        outs.append(greedy(r, prompts, 40))
        assert bool(calls) == kernel, "the kernel runs exactly when the runner says so"
        calls.clear()
    assert outs[0] == outs[1]
