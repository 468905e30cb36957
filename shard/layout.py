"""Builds a step's attention layout: where each new token's keys and values go in each pool, and the padded
groups (decodes, prompt chunks) each attention call runs over. See attention.py for how layers read it.

A step's token count is padded up to a bucket (`bucket`): at most 7 more rows below 128 and 12.5% more beyond,
so a server only ever runs a few dozen distinct shapes. oneDNN builds and caches a kernel per (shape, weight),
so unpadded steps of every size from 1 to a few thousand grew a shard's RSS by ~3 MB per new size, up to its
two 1,024-entry caches, and paid a kernel build on each new size. Padded tokens write their keys and values
into a scratch block no request owns and belong to no attention group; their logits are never computed. That
was bf16, whose linears are oneDNN primitives; float32 on CPU (MKL's GEMMs) builds nothing per shape (a sweep of
1..400 unpadded steps grew a shard by 47 MB, padded by 44), so its steps run at their own size (runner.py):
padding there cost up to 8% of a decode step.
"""
import torch

from shard.attention import Group, PoolStep, StepLayout


def slots(table: list[int], base: int, start: int, n: int, block_size: int) -> list[int]:
    """Cache slot of positions start..start+n-1, in a block table whose first block is logical block `base`."""
    return [table[p // block_size - base] * block_size + p % block_size for p in range(start, start + n)]


def bucket(n: int, fine: int = 8) -> int:
    """n padded up: the powers of two up to `fine`, then multiples of `fine` up to 16 * fine and of a sixteenth
    of the next power of two beyond. For step tokens (fine 8): 1, 2, 4, 8, 16, 24, ..., 128, 144, ..., 256, 288."""
    if n <= fine:
        return 1 << max(n - 1, 0).bit_length()
    step = max(fine, 1 << max((n - 1).bit_length() - 4, 0))
    return -(-n // step) * step


GROUP_OVERHEAD = 48  # (request, block) pairs: an extra decode group costs ~ gathering and attending over 48 more


def split_decodes(members: list[tuple]) -> list[list[tuple]]:
    """Decodes sorted by block-table width, cut into up to 4 groups of similar widths: one group pads every
    request to the longest one's width, and gathers and attends over all of it in every layer."""
    cut = _best_cut(members)
    if cut is None:
        return [members]
    return [part for half in (members[:cut], members[cut:]) for part in _split_once(half)]


def _split_once(members: list[tuple]) -> list[list[tuple]]:
    cut = _best_cut(members)
    return [members] if cut is None else [members[:cut], members[cut:]]


def _best_cut(members: list[tuple]) -> int | None:
    """Where one cut saves more padded (request, block) pairs than a group costs, the best such place."""
    widths = [len(st.blocks) for _, _, st in members]
    n = len(widths)
    best, cut = _padded(n, widths[-1]) - GROUP_OVERHEAD, None
    for i in range(1, n):
        cost = _padded(i, widths[i - 1]) + _padded(n - i, widths[-1])
        if cost < best:
            best, cut = cost, i
    return cut


def _padded(size: int, width: int) -> int:
    return bucket(size, 4) * bucket(width, 4)


def build(members: list[list[tuple]], full_slots: list[int], window_slots: list[int] | None,
          cache, block_size: int, device: torch.device, tokens: int, kernel: bool = False) -> StepLayout:
    """members: the groups, each a list of (offset in the ragged batch, tokens, RequestState); slots: each row's
    cache slot in each pool; tokens: the step's real tokens (the rows after them are padding). Every tensor is
    made once from Python lists: per-request tensor ops cost ~10 us each, 9 ms a step at 64 requests."""
    def pool_step(token_slots: list[int], window: bool) -> PoolStep:
        return PoolStep(torch.tensor(token_slots, device=device),
                        [_group(g, window, block_size, device) for g in members], block_size, {})

    return StepLayout(full=pool_step(full_slots, False),
                      window=pool_step(window_slots, True) if window_slots is not None else None,
                      cache=cache.layers, tokens=tokens, kernel=kernel)


def _group(members, window: bool, block_size: int, device: torch.device) -> Group:
    """window: address the sliding layers' pool (window tables, keys from window_base on)."""
    tables = [st.window_blocks if window else st.blocks for _, _, st in members]
    width = max(len(t) for t in tables)
    q = max(n for _, n, _ in members)
    size = len(members)
    if q == 1:  # decodes attend through batched matmuls, which oneDNN builds and caches per shape: pad both
        size, width = bucket(size, 4), bucket(width, 4)
    extra = size - len(members)  # padding members: no queries, block 0
    rows = [list(range(offset, offset + n)) + [0] * (q - n) for offset, n, _ in members] + [[0] * q] * extra
    valid = [[True] * n + [False] * (q - n) for _, n, _ in members] + [[False] * q] * extra
    qpos = [list(range(st.cached, st.cached + n)) + [0] * (q - n) for _, n, st in members] + [[0] * q] * extra
    padded = [t + [0] * (width - len(t)) for t in tables] + [[0] * width] * extra
    kv_len = [st.cached + n for _, n, st in members] + [0] * extra
    key_start = [st.window_base * block_size if window else 0 for _, _, st in members] + [0] * extra
    offsets = [offset for offset, _, _ in members]
    dense = offsets[0] if q == 1 and offsets == list(range(offsets[0], offsets[0] + len(members))) else None
    long = torch.long
    return Group(torch.tensor(rows, dtype=long, device=device), torch.tensor(valid, device=device),
                 torch.tensor(padded, dtype=long, device=device), torch.tensor(qpos, dtype=long),
                 torch.tensor(kv_len, dtype=long), torch.tensor(key_start, dtype=long), len(members), dense)
