"""The physical paged KV cache of one rank, and how big it can be.

Two pools, each one tensor [layers, 2, kv_heads, num_blocks, block_size, head_dim] (head-major, so a request's
gathered blocks are contiguous per head). `full` holds the full-attention layers: block b of every such layer
belongs to the same request, so one block table addresses them all. `window` holds the sliding-window layers
of hybrid models (None otherwise): they only ever need the last window of tokens, so they get their own,
much smaller pool and block table, from which the router drops blocks that slid out of the window.
"""
import math
import mmap
from dataclasses import dataclass

import psutil
import torch


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return num_layers * 2 * block_size * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


def free_memory(device: torch.device, local_world_size: int) -> int:
    """Bytes this rank may still use: free device memory, or on CPU its share of the available RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return psutil.virtual_memory().available // local_world_size  # Linux: /proc/meminfo's MemAvailable


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled pool. On CPU an anonymous mapping, which the kernel hands out zeroed page by page as the
    pool is first written: torch.zeros wrote all of it at start-up (3.3 s for the default 2.9 GB pool on a 2-core
    EPYC) and made every page resident before any request needed it."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    memory = mmap.mmap(-1, count * torch.empty((), dtype=dtype).element_size())
    return torch.frombuffer(memory, dtype=dtype, count=count).view(shape)  # the tensor keeps the mapping alive


class KVCache:
    def __init__(self, sliding: list[bool], num_blocks: int, num_window_blocks: int, block_size: int,
                 kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        """sliding[i]: layer i attends within the sliding window (and so lives in the window pool)."""
        def pool(layers: int, blocks: int) -> torch.Tensor:  # one more block: the padding's scratch (layout.py)
            return zeros((layers, 2, kv_heads, blocks + 1, block_size, head_dim), dtype, device)

        self.full = pool(sliding.count(False), num_blocks)
        self.window: torch.Tensor | None = pool(sliding.count(True), num_window_blocks) if any(sliding) else None
        self.num_blocks, self.num_window_blocks = num_blocks, num_window_blocks  # the router's to allocate
        self.scratch_slot = (num_blocks * block_size, num_window_blocks * block_size)  # (full, window) pools
        # layer index -> (pool, index in pool)
        self.where: list[tuple[torch.Tensor, int]] = []
        for s in sliding:
            p = self.window if s else self.full
            self.where.append((p, sum(q is p for q, _ in self.where)))
        # layer index -> (in the window pool, keys, values), each [kv_heads, blocks, block_size, head_dim]
        self.layers = [(p is self.window, p[j, 0], p[j, 1]) for p, j in self.where]


@dataclass
class PoolSizes:
    num_blocks: int
    num_window_blocks: int
    num_swap_blocks: int
    bytes_per_block: int
    bytes_per_window_block: int


def size_pools(sliding: list[bool], sliding_window: int, block_size: int, kv_heads: int, head_dim: int,
               dtype: torch.dtype, device: torch.device, world: int, *, num_blocks: int, max_prefill_tokens: int,
               max_batch_size: int, max_total_tokens: int, memory_fraction: float, swap_bytes: int) -> PoolSizes:
    """How many blocks each pool gets: `num_blocks` when the router fixed it, else what fits in
    `memory_fraction` of the free memory (after the activations a warm-up measured), never more than
    max_batch_size requests of max_total_tokens could use.

    The window pool is sized so that it never runs out. In a step computing n of its tokens, a request's window
    table spans from its oldest visible key (first query - window + 1) to its newest token: at most
    ceil((window - 1) / bs) + 1 + ceil((n - 1) / bs) blocks, and over the batch the last terms add up to at most
    ceil(max_prefill_tokens / bs) + max_batch_size. Nor can it need more blocks than the full pool has: a
    window table holds a subset of the same request's blocks. The swap pool mirrors at most the device pool.
    """
    window_layers = sum(sliding)
    per_block = bytes_per_block(len(sliding) - window_layers, block_size, kv_heads, head_dim, dtype)
    per_window_block = bytes_per_block(window_layers, block_size, kv_heads, head_dim, dtype)
    most_window = 0
    if window_layers:
        most_window = (max_batch_size * (ceil_div(sliding_window - 1, block_size) + 2)
                       + ceil_div(max(max_prefill_tokens, 1), block_size))
    if not num_blocks:
        budget = free_memory(device, world if device.type == "cpu" else 1) * memory_fraction
        if device.type == "cpu":  # the swap pool (at most the pool's size) comes out of the same RAM
            budget -= min(swap_bytes, budget / 2)
        fit = int((budget - most_window * per_window_block) // per_block)
        if fit < most_window:  # too little memory for both: pools of equal size
            fit = int(budget // (per_block + per_window_block))
        most_ever = max_batch_size * ceil_div(max_total_tokens, block_size)
        num_blocks = min(fit, most_ever or fit)
    swap = min(swap_bytes // per_block, num_blocks) if num_blocks > 0 and per_block else 0
    return PoolSizes(num_blocks, min(most_window, num_blocks), swap, per_block, per_window_block)
