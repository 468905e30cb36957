"""Paged attention for transformers models: registered as an attention implementation, so any causal LM
whose attention layers call `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]` runs on our KV cache.

The model sees one ragged sequence (all scheduled tokens of all requests, batch dimension 1). Each layer's
new keys and values are written into the cache at their slots; then each request attends to its own blocks.
Requests are grouped in two padded batches built once per step (`StepLayout`): decodes (one query each) and
prompt chunks (causal within the chunk, after everything cached before it). The linear layers never see
padding; only these two attention calls do.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

NAME = "cb_paged"


@dataclass
class Group:
    """A padded batch of requests for one attention call."""
    rows: torch.Tensor         # [B, Q] index of each query in the ragged sequence
    valid: torch.Tensor        # [B, Q] bool: the query exists (not padding)
    block_tables: torch.Tensor  # [B, NB] physical blocks of each request (padded with block 0)
    query_pos: torch.Tensor    # [B, Q] position of each query in its sequence
    kv_len: torch.Tensor       # [B] tokens visible to the request after this step

    def mask(self, block_size: int, window: Optional[int]) -> torch.Tensor:
        """[B, 1, Q, K] bool: key j is visible to query i (causal, within kv_len, inside the window)."""
        keys = torch.arange(self.block_tables.shape[1] * block_size)
        qpos = self.query_pos.unsqueeze(-1)
        visible = (keys <= qpos) & (keys < self.kv_len.view(-1, 1, 1))
        if window:
            visible &= keys > qpos - window
        visible[..., 0] |= ~self.valid  # padded queries look at one key rather than none (no NaN)
        return visible.unsqueeze(1)


@dataclass
class StepLayout:
    slots: torch.Tensor        # [T] cache slot of each token in the ragged sequence
    groups: list[Group]
    block_size: int
    cache: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v): [num_blocks, block_size, kv_heads, dim]
    _masks: dict

    def mask(self, i: int, window: Optional[int]) -> torch.Tensor:
        key = (i, window)
        if key not in self._masks:
            self._masks[key] = self.groups[i].mask(self.block_size, window).to(self.slots.device)
        return self._masks[key]


_current: Optional[StepLayout] = None


def set_step(layout: Optional[StepLayout]) -> None:
    """The runner sets the step's layout before the forward pass; every layer reads it."""
    global _current
    _current = layout


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    layout = _current
    k_cache, v_cache = layout.cache[module.layer_idx]
    nb, bs, hkv, dim = k_cache.shape
    flat_k = k_cache.view(nb * bs, hkv, dim)
    flat_v = v_cache.view(nb * bs, hkv, dim)
    flat_k.index_copy_(0, layout.slots, key[0].transpose(0, 1).to(k_cache.dtype))
    flat_v.index_copy_(0, layout.slots, value[0].transpose(0, 1).to(v_cache.dtype))

    q = query[0].transpose(0, 1)  # [T, H, D]
    out = torch.empty_like(q)
    window = getattr(module, "sliding_window", None)
    for i, g in enumerate(layout.groups):
        b, width = g.block_tables.shape
        qg = q[g.rows].transpose(1, 2)  # [B, H, Q, D]
        kg = k_cache[g.block_tables].view(b, width * bs, hkv, dim).transpose(1, 2)
        vg = v_cache[g.block_tables].view(b, width * bs, hkv, dim).transpose(1, 2)
        og = F.scaled_dot_product_attention(
            qg, kg, vg, attn_mask=layout.mask(i, window), scale=scaling, enable_gqa=True,
        )
        out[g.rows[g.valid]] = og.transpose(1, 2)[g.valid]
    return out.unsqueeze(0), None


AttentionInterface.register(NAME, paged_attention)
