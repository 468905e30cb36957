"""Builds a step's attention layout: where each new token's keys and values go in each pool, and the padded
groups (decodes, prompt chunks) each attention call runs over. See attention.py for how layers read it."""
import torch

from shard.attention import Group, PoolStep, StepLayout


def slots(table: list[int], base: int, pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot of each position, in a block table whose first block is logical block `base`."""
    return torch.tensor(table)[pos // block_size - base] * block_size + pos % block_size


def build(members: list[list[tuple]], full_slots: list[torch.Tensor], window_slots: list[torch.Tensor] | None,
          cache, block_size: int, device: torch.device) -> StepLayout:
    """members: the groups, each a list of (offset in the ragged batch, tokens, RequestState)."""
    def pool_step(token_slots: list[torch.Tensor], window: bool) -> PoolStep:
        return PoolStep(torch.cat(token_slots).to(device), [_group(g, window, block_size, device) for g in members],
                        block_size, {})

    return StepLayout(full=pool_step(full_slots, False),
                      window=pool_step(window_slots, True) if window_slots is not None else None,
                      cache=cache.layers)


def _group(members, window: bool, block_size: int, device: torch.device) -> Group:
    """window: address the sliding layers' pool (window tables, keys from window_base on)."""
    tables = [st.window_blocks if window else st.blocks for _, _, st in members]
    width = max(len(t) for t in tables)
    q = max(n for _, n, _ in members)
    rows = torch.zeros(len(members), q, dtype=torch.long)
    valid = torch.zeros(len(members), q, dtype=torch.bool)
    padded = torch.zeros(len(members), width, dtype=torch.long)
    qpos = torch.zeros(len(members), q, dtype=torch.long)
    kv_len = torch.zeros(len(members), dtype=torch.long)
    key_start = torch.zeros(len(members), dtype=torch.long)
    for i, ((offset, n, st), table) in enumerate(zip(members, tables)):
        rows[i, :n] = torch.arange(offset, offset + n)
        valid[i, :n] = True
        padded[i, :len(table)] = torch.tensor(table)
        qpos[i, :n] = torch.arange(st.cached, st.cached + n)
        kv_len[i] = st.cached + n
        key_start[i] = st.window_base * block_size if window else 0
    offsets = [offset for offset, _, _ in members]
    dense = (offsets[0], len(members)) if q == 1 and offsets == list(range(offsets[0], offsets[0] + len(members))) \
        else None
    return Group(rows.to(device), valid.to(device), padded.to(device), qpos, kv_len, key_start, dense)
