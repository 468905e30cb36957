"""Paged attention for transformers models: registered as an attention implementation, so any causal LM
whose attention layers call `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]` runs on our KV cache.

The model sees one ragged sequence (all scheduled tokens of all requests, batch dimension 1). Each layer's
new keys and values are written into the cache at their slots; then each request attends to its own blocks.
Requests are grouped in padded batches built once per step (`StepLayout`): prompt chunks (causal within the
chunk, after everything cached before it), and decodes (one query each) in up to four groups of similar length. The linear layers never see
padding; only these two attention calls do. On CPU the C kernels (paged_kernel.py) read both kinds in place through
the block tables, unpadded, and these batches are the torch path where the kernels are off or decline.

Hybrid models keep their sliding-window layers in a second pool (see kv_cache.py) with a per-request block
table that starts at some block of the sequence rather than its first: each pool has its own `PoolStep` (slots
and block tables), and a group's keys start at `key_start` instead of position 0.
"""
import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from shard import paged_kernel
from shard.profiling import scope

NAME = "cb_paged"


SHORT_CHUNK = 32  # queries a prompt chunk may have to attend through the decode kernel (Group.query_args)


@dataclass
class Group:
    """A padded batch of requests for one attention call."""
    rows: torch.Tensor         # [B, Q] index of each query in the ragged sequence
    valid: torch.Tensor        # [B, Q] bool: the query exists (not padding)
    block_tables: torch.Tensor  # [B, NB] physical blocks of each request (padded with block 0)
    query_pos: torch.Tensor    # [B, Q] position of each query in its sequence
    kv_len: torch.Tensor       # [B] tokens visible to the request after this step
    key_start: torch.Tensor    # [B] position of the first key in the block table (0 but in the window pool)
    members: int               # the real requests: the first `members` of B (decode groups are padded, layout.py)
    dense: int | None = None   # the first row, when the group is one query each and its rows are consecutive
    _kernel: tuple | None = None  # kernel_args or chunk_args, whichever kind the group is
    _queries: tuple | None = None  # query_args

    def kernel_args(self) -> tuple:
        """The real members' rows, block tables, key starts and lengths as paged_kernel.decode takes them (made
        once a step, not in every layer)."""
        if self._kernel is None:
            n = self.members
            self._kernel = (self.rows[:n, 0].contiguous(), self.block_tables[:n].contiguous(),
                            self.key_start[:n].contiguous(), self.kv_len[:n].contiguous())
        return self._kernel

    def chunk_args(self) -> tuple:
        """Prompt chunks as paged_kernel.prefill takes them: each chunk's first row, query count, first query's
        position, block table and key start (made once a step)."""
        if self._kernel is None:
            n = self.members
            self._kernel = (self.rows[:n, 0].contiguous(), self.valid[:n].sum(1), self.query_pos[:n, 0].contiguous(),
                            self.block_tables[:n].contiguous(), self.key_start[:n].contiguous())
        return self._kernel

    def query_args(self) -> tuple | None:
        """Prompt chunks of at most SHORT_CHUNK queries each as paged_kernel.decode takes them, one entry a query
        (its row, its chunk's block table and key start, its position + 1 as the keys it sees); None when a chunk
        is longer. The decode kernel reads the keys in place and scores them in bf16 dot products, where the chunk
        kernel first widens and transposes every key a chunk sees: a pacer's chunk of 16 queries at position
        1,000 took 7.2 ms against 22.4 (30 layers, SmolLM2, the EPYC); from 64 queries the chunk kernel wins.
        bf16 caches only: in float32 every chunk keeps the chunk kernel, so a prompt's last position gives the same
        logits to the bit whether a cached prefix left it a short chunk or not (test_speculation_e2e's prefix reuse)."""
        if self._queries is None:
            rows, count, pos, tables, key_start = self.chunk_args()
            if int(count.max()) > SHORT_CHUNK:
                self._queries = (None,)
            else:
                chunk = torch.repeat_interleave(torch.arange(count.shape[0]), count)
                offset = torch.arange(chunk.shape[0]) - torch.repeat_interleave(torch.cumsum(count, 0) - count, count)
                self._queries = (rows[chunk] + offset, tables[chunk].contiguous(), key_start[chunk].contiguous(),
                                 pos[chunk] + offset + 1)
        return None if self._queries[0] is None else self._queries

    def mask(self, block_size: int, window: int | None) -> torch.Tensor:
        """[B, Q, K] bool: key j is visible to query i (causal, within kv_len, inside the window)."""
        keys = self.key_start.view(-1, 1, 1) + torch.arange(self.block_tables.shape[1] * block_size)
        qpos = self.query_pos.unsqueeze(-1)
        visible = (keys <= qpos) & (keys < self.kv_len.view(-1, 1, 1))
        if window:
            visible &= keys > qpos - window
        visible[..., 0] |= ~self.valid.cpu()  # padded queries look at one key rather than none (no NaN)
        return visible


@dataclass
class PoolStep:
    """One pool's share of the step: where each new token's K/V goes, and what each group attends to."""
    slots: torch.Tensor        # [T] cache slot of each token in the ragged sequence
    groups: list[Group]
    block_size: int
    _masks: dict  # per (group, window), built once per step
    _buffers: dict = field(default_factory=dict)  # gather buffers per (group, dtype), reused by every layer

    def mask(self, i: int, window: int | None) -> torch.Tensor:
        key = (i, window)
        if key not in self._masks:
            self._masks[key] = self.groups[i].mask(self.block_size, window).to(self.slots.device)
        return self._masks[key]

    def gather(self, i: int, cache: torch.Tensor) -> torch.Tensor:
        """Group i's blocks of one layer's keys or values [Hkv, blocks, block_size, D], as [Hkv, B, L, D]. Whole
        blocks are copied (index_select over rows of block_size * D elements, several times faster than indexing
        token by token) into a buffer the step reuses in every layer."""
        grp = self.groups[i]
        hkv, nb, bs, dim = cache.shape
        b, width = grp.block_tables.shape
        key = (i, cache.dtype)
        if key not in self._buffers:
            self._buffers[key] = [torch.empty(hkv, b * width, bs * dim, dtype=cache.dtype, device=cache.device)
                                  for _ in range(2)]
        buffers = self._buffers[key]
        out = buffers.pop(0)
        buffers.append(out)  # keys and values alternate between the two buffers
        torch.index_select(cache.view(hkv, nb, bs * dim), 1, grp.block_tables.view(-1), out=out)
        return out.view(hkv, b, width * bs, dim)


@dataclass
class StepLayout:
    full: PoolStep
    window: PoolStep | None  # hybrid models: the sliding-window layers' pool
    cache: list[tuple[bool, torch.Tensor, torch.Tensor]]  # per layer (in the window pool, k, v), see KVCache
    tokens: int  # the real tokens; rows after them pad the step to its bucket (layout.py)
    kernel: bool = False  # decodes and prompt chunks attend through paged_kernel (in place), not a gather


_steps = threading.local()  # per thread: a shard compiles its step sizes on a scratch pool while it serves


def set_step(layout: StepLayout | None) -> None:
    """The runner sets the step's layout before the forward pass; every layer reads it."""
    _steps.layout = layout


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface: query [1, H, T, D], key/value [1, Hkv, T, D] -> [1, T, H, D]."""
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    out = attend(module.layer_idx, query[0], key[0], value[0], scaling, window)
    return out.view(query.shape[2], query.shape[1], -1).unsqueeze(0), None


def attend(layer: int, query, key, value, scaling, window) -> torch.Tensor:
    """Writes one layer's new keys and values to the cache, then attends through each request's block table.
    query [H, T, D], key/value [Hkv, T, D] -> [T, H * D]. The cache is head-major ([Hkv, blocks, block_size, D]),
    so gathering a request's blocks yields contiguous [L, D] matrices per head."""
    current = _steps.layout
    in_window, k_cache, v_cache = current.cache[layer]
    step = current.window if in_window else current.full
    hkv, nb, bs, dim = k_cache.shape
    with scope("attention::cache_write"):
        k_cache.view(hkv, nb * bs, dim).index_copy_(1, step.slots, key.to(k_cache.dtype))
        v_cache.view(hkv, nb * bs, dim).index_copy_(1, step.slots, value.to(v_cache.dtype))
    heads, tokens = query.shape[0], query.shape[1]
    q = query.view(hkv, heads // hkv, tokens, dim)
    flat = torch.empty(tokens, heads, dim, dtype=query.dtype, device=query.device)  # the layer's output layout
    if current.tokens < tokens:
        flat[current.tokens:] = 0  # padding rows: no group writes them
    out = flat.transpose(0, 1).view(hkv, heads // hkv, tokens, dim)
    scale = scaling if scaling is not None else dim ** -0.5
    in_place = (current.kernel and query.dtype == k_cache.dtype and query.dtype in paged_kernel.DTYPES
                and query.stride(-1) == 1)
    for i, grp in enumerate(step.groups):
        if in_place:
            with scope("attention::attend"):
                if grp.rows.shape[1] == 1:
                    rows, tables, key_start, kv_len = grp.kernel_args()
                    done = paged_kernel.decode(query, rows, k_cache, v_cache, tables, key_start, kv_len, window,
                                               flat.transpose(0, 1), scale)
                elif k_cache.dtype == torch.bfloat16 and (short := grp.query_args()) is not None:
                    rows, tables, key_start, kv_len = short
                    done = paged_kernel.decode(query, rows, k_cache, v_cache, tables, key_start, kv_len, window,
                                               flat.transpose(0, 1), scale)
                else:
                    rows, count, pos, tables, key_start = grp.chunk_args()
                    done = paged_kernel.prefill(query, rows, count, pos, k_cache, v_cache, tables, key_start, window,
                                                flat.transpose(0, 1), scale)
            if done:
                continue
        with scope("attention::gather"):
            kg, vg = step.gather(i, k_cache), step.gather(i, v_cache)
        with scope("attention::attend"):
            if grp.rows.shape[1] == 1:  # decodes: consecutive rows are a plain slice, no indexing
                n = grp.members
                rows = slice(grp.dense, grp.dense + n) if grp.dense is not None else grp.rows[:n, 0]
                qd = F.pad(q[:, :, rows], (0, 0, 0, grp.rows.shape[0] - n))  # padding members: zero queries
                out[:, :, rows] = _decodes(qd, kg, vg, step.mask(i, window), scale)[:, :, :n]
            else:
                og = _chunks(q[:, :, grp.rows], kg, vg, step.mask(i, window), scale)
                out[:, :, grp.rows[grp.valid]] = og[:, :, grp.valid]
    return flat.view(tokens, heads * dim)


def _decodes(q, k, v, mask, scale):
    """One query per request: two batched matmuls and a float32 softmax (on CPU twice as fast as SDPA's
    masked path). q [Hkv, G, B, D], k/v [Hkv, B, L, D], mask [B, 1, L] -> [Hkv, G, B, D]."""
    qb = q.transpose(1, 2).to(k.dtype)  # [Hkv, B, G, D]
    scores = torch.matmul(qb, k.transpose(-1, -2)).float().mul_(scale)
    scores.masked_fill_(~mask.unsqueeze(0), float("-inf"))
    out = torch.matmul(scores.softmax(-1).to(v.dtype), v)  # [Hkv, B, G, D]
    return out.transpose(1, 2).to(q.dtype)


def _chunks(q, k, v, mask, scale):
    """Prompt chunks: SDPA's fused kernel. q [Hkv, G, B, Q, D], k/v [Hkv, B, L, D], mask [B, Q, L]."""
    hkv, g, b, n_q, dim = q.shape
    qb = q.permute(2, 0, 1, 3, 4).reshape(b, hkv * g, n_q, dim)
    out = F.scaled_dot_product_attention(qb.to(k.dtype), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask.unsqueeze(1), scale=scale, enable_gqa=True)
    return out.view(b, hkv, g, n_q, dim).permute(1, 2, 0, 3, 4).to(q.dtype)


AttentionInterface.register(NAME, paged_attention)
