"""The physical paged KV cache of one rank, and how big it can be.

Two pools, each one tensor [layers, 2, kv_heads, num_blocks, block_size, head_dim] (head-major, so a request's
gathered blocks are contiguous per head). `full` holds the full-attention layers: block b of every such layer
belongs to the same request, so one block table addresses them all. `window` holds the sliding-window layers
of hybrid models (None otherwise): they only ever need the last window of tokens, so they get their own,
much smaller pool and block table, from which the router drops blocks that slid out of the window.
"""

import torch


def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return num_layers * 2 * block_size * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


def free_memory(device: torch.device, local_world_size: int) -> int:
    """Bytes this rank may still use: free device memory, or on CPU its share of the available RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024 // local_world_size


class KVCache:
    def __init__(self, sliding: list[bool], num_blocks: int, num_window_blocks: int, block_size: int,
                 kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        """sliding[i]: layer i attends within the sliding window (and so lives in the window pool)."""
        def pool(layers: int, blocks: int) -> torch.Tensor:
            return torch.zeros((layers, 2, kv_heads, blocks, block_size, head_dim), dtype=dtype, device=device)

        self.full = pool(sliding.count(False), num_blocks)
        self.window: torch.Tensor | None = pool(sliding.count(True), num_window_blocks) if any(sliding) else None
        # layer index -> (pool, index in pool)
        self.where: list[tuple[torch.Tensor, int]] = []
        for s in sliding:
            p = self.window if s else self.full
            self.where.append((p, sum(q is p for q, _ in self.where)))
        # layer index -> (in the window pool, keys, values), each [kv_heads, blocks, block_size, head_dim]
        self.layers = [(p is self.window, p[j, 0], p[j, 1]) for p, j in self.where]
