"""The physical paged KV cache of one rank, and how big it can be.

One tensor holds every layer's keys and values: [layers, 2, kv_heads, num_blocks, block_size, head_dim]
(head-major, so a request's gathered blocks are contiguous per head). Block b of every layer belongs to the
same request, so the router's block table addresses all layers at once.
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
    def __init__(self, num_layers, num_blocks, block_size, kv_heads, head_dim, dtype, device):
        shape = (num_layers, 2, kv_heads, num_blocks, block_size, head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = [(self.data[i, 0], self.data[i, 1]) for i in range(num_layers)]
