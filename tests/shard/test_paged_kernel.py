"""The attention kernels (shard/kernels/paged_decode.c, paged_prefill.c) read the cache in place through the block
tables; they must give what the torch paths (gather the blocks, then batched matmuls and a float32 softmax for
decodes, SDPA for prompt chunks) give, and a Runner using them must serve the same greedy tokens."""
import pytest
import torch

from shard import attention, cpu, paged_kernel
from shard.model import load
from shard.runner import Runner

from serve import greedy

CPU = torch.device("cpu")
VECTORS = "avx512f" in cpu.flags() or {"avx2", "fma"} <= set(cpu.flags())
chunk_kernel = pytest.mark.skipif(not VECTORS, reason="the chunk kernel needs AVX-512 or AVX2 with FMA (else declines)")


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


def _chunk_caches(chunks, hkv: int, dim: int, dtype, bs: int, spare: int):
    """Random key and value caches with `spare` blocks beyond the chunks' own, and each chunk's block table (its
    blocks, (cached tokens + queries) worth, drawn in a shuffled order; padded with block 0)."""
    widths = [-(-(c + n) // bs) for c, n in chunks]
    width, blocks = max(widths), sum(widths) + spare
    kc, vc = (torch.randn(hkv, blocks, bs, dim).to(dtype) for _ in range(2))
    order = torch.randperm(blocks).tolist()
    tables = torch.tensor([order[sum(widths[:b]):sum(widths[:b + 1])] + [0] * (width - widths[b])
                           for b in range(len(chunks))])
    return kc, vc, tables


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("hkv, group, dim, window, key_start", [(3, 3, 64, None, 0), (1, 4, 256, 96, 32),
                                                                 (2, 8, 128, None, 0), (2, 5, 32, 40, 0),
                                                                 (1, 1, 16, None, 16)])
@chunk_kernel
@pytest.mark.parametrize("chunks", [[(0, 37)], [(0, 5), (100, 64), (17, 130)], [(300, 50), (0, 300), (2, 1)]])
def test_prefill_kernel_equals_sdpa_over_the_gathered_blocks(dtype, tol, hkv, group, dim, window, key_start, chunks):
    """Chunks (cached tokens before them, tokens) of every size, after a cached prefix or not, a window pool's
    tables that start at key_start; the queries of several chunks (and of no chunk) in one ragged step."""
    torch.manual_seed(0)
    bs = 16
    kc, vc, tables = _chunk_caches(chunks, hkv, dim, dtype, bs, spare=2)
    width = tables.shape[1]
    starts = torch.full((len(chunks),), key_start)
    pos = torch.tensor([key_start + c for c, _ in chunks])
    count = torch.tensor([n for _, n in chunks])
    rows = torch.cumsum(torch.tensor([1] + [n for _, n in chunks[:-1]]), 0)  # row 0 and the last two: no chunk's
    tokens = 3 + int(count.sum())
    q = torch.randn(tokens, hkv * group, dim).to(dtype).transpose(0, 1)
    out = torch.full((tokens, hkv * group, dim), 7.0, dtype=dtype).transpose(0, 1)
    assert paged_kernel.prefill(q, rows, count, pos, kc, vc, tables, starts, window, out, dim ** -0.5)
    for b, (c, n) in enumerate(chunks):
        keys = key_start + torch.arange(width * bs)
        qpos = (pos[b] + torch.arange(n))[:, None]
        visible = (keys <= qpos) & (keys > qpos - window if window else True)
        kg, vg = (cache[:, tables[b]].reshape(hkv, 1, width * bs, dim) for cache in (kc, vc))
        qb = q[:, rows[b]:rows[b] + n].reshape(hkv, group, 1, n, dim)
        ref = attention._chunks(qb, kg, vg, visible[None], dim ** -0.5)[:, :, 0]  # [Hkv, G, n, D]
        got = out[:, rows[b]:rows[b] + n].reshape(hkv, group, n, dim)
        assert (got.float() - ref.float()).abs().max() < tol, (b, c, n)
    assert (out[:, [0, tokens - 2, tokens - 1]] == 7.0).all(), "rows of no chunk are left alone"


@chunk_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 20])
def test_short_chunks_through_the_decode_kernel_equal_the_chunk_kernel(dtype, window):
    """Group.query_args: chunks of at most SHORT_CHUNK queries attend one query at a time through the decode kernel,
    each over its own causal prefix (and window); a longer chunk in the group sends it all to the chunk kernel."""
    torch.manual_seed(0)
    hkv, group, dim, bs = 3, 3, 64, 16
    chunks = [(0, 5), (100, 16), (1000, 32), (7, 1)]  # (cached tokens before, queries)
    kc, vc, tables = _chunk_caches(chunks, hkv, dim, dtype, bs, spare=1)
    q_len = max(n for _, n in chunks)
    first = torch.cumsum(torch.tensor([0] + [n for _, n in chunks[:-1]]), 0)
    steps = torch.arange(q_len)
    valid = torch.stack([steps < n for _, n in chunks])
    grp = attention.Group(rows=torch.where(valid, first[:, None] + steps, 0), valid=valid, block_tables=tables,
                          query_pos=torch.tensor([c for c, _ in chunks])[:, None] + steps,
                          kv_len=torch.tensor([c + n for c, n in chunks]), key_start=torch.zeros(len(chunks),
                          dtype=torch.long), members=len(chunks))
    tokens = sum(n for _, n in chunks)
    q = torch.randn(tokens, hkv * group, dim).to(dtype).transpose(0, 1)
    want, got = (torch.full((tokens, hkv * group, dim), 7.0, dtype=dtype).transpose(0, 1) for _ in range(2))
    assert paged_kernel.prefill(q, *grp.chunk_args()[:3], kc, vc, tables, grp.key_start, window, want, 0.125)
    rows, tables_q, key_start, kv_len = grp.query_args()
    assert rows.tolist() == list(range(tokens)) and kv_len[-1] == 8
    assert paged_kernel.decode(q, rows, kc, vc, tables_q, key_start, kv_len, window, got, 0.125)
    assert (got.float() - want.float()).abs().max() < (2e-2 if dtype == torch.bfloat16 else 2e-5)
    valid[2, :] = True  # a chunk of SHORT_CHUNK + 1 queries: not short
    long = attention.Group(rows=grp.rows, valid=torch.cat([valid, valid[:, :1]], 1), block_tables=tables,
                           query_pos=grp.query_pos, kv_len=grp.kv_len, key_start=grp.key_start, members=len(chunks))
    assert attention.SHORT_CHUNK == 32 and long.query_args() is None


def test_shapes_beyond_the_kernel_are_declined():
    kc = torch.zeros(1, 2, 16, 8)
    one = torch.zeros(1, dtype=torch.long)
    assert not paged_kernel.decode(torch.zeros(17, 1, 8), one, kc, kc, torch.zeros(1, 1, dtype=torch.long), one,
                                   one + 1, None, torch.zeros(17, 1, 8), 1.0), "17 query heads per KV head"
    two = one + 2
    assert not paged_kernel.prefill(torch.zeros(1, 2, 8), one, two, one, kc, kc, torch.zeros(1, 1, dtype=torch.long),
                                    one, None, torch.zeros(1, 2, 8), 1.0), "a head size not a multiple of 16"
    if not VECTORS:  # the torch path takes every chunk there
        kc = torch.zeros(1, 2, 16, 16)
        assert not paged_kernel.prefill(torch.zeros(1, 2, 16), one, two, one, kc, kc,
                                        torch.zeros(1, 1, dtype=torch.long), one, None, torch.zeros(1, 2, 16), 1.0)


def test_runner_with_the_kernel_serves_the_same_tokens(tiny_llama, monkeypatch):
    loaded = load(str(tiny_llama), "float32", CPU, 0, 1)
    prompts = {i: [(5 + 11 * i + 3 * k) % 500 for k in range(9 + 23 * i)] for i in range(5)}
    outs = []
    calls = []
    for name in ("decode", "prefill"):
        monkeypatch.setattr(paged_kernel, name, lambda *a, kernel=getattr(paged_kernel, name), name=name:
                            calls.append(name) or kernel(*a))
    for kernel in (True, False):
        r = Runner(loaded, CPU, 16, 0, 1)
        assert r.kernel
        r.kernel = kernel
        r.allocate(128)
        outs.append(greedy(r, prompts, 40))
        assert set(calls) == ({"decode", "prefill"} if kernel else set()), "the kernels run when the runner says so"
        calls.clear()
    assert outs[0] == outs[1]
