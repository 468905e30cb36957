"""Host memory where offloaded requests' KV blocks wait (pinned on CUDA, so copies run at full bus speed).

The router picks the slots; a shard only copies. Each direction is one gather and one scatter over the whole
list of blocks, whatever their number: offloading 40 blocks costs one transfer, not 40.
"""
import torch


class SwapPool:
    def __init__(self, pool: torch.Tensor, num_slots: int):
        """`pool`: the device pool [layers, 2, kv_heads, blocks, block_size, head_dim]; slots mirror a block."""
        shape = list(pool.shape)
        shape[3] = num_slots
        self.data = torch.empty(shape, dtype=pool.dtype, pin_memory=pool.is_cuda)  # written before it is read

    @property
    def num_slots(self) -> int:
        return self.data.shape[3]

    def offload(self, pool: torch.Tensor, blocks: list[int], slots: list[int]) -> None:
        if blocks:
            src = torch.tensor(blocks, device=pool.device)
            self.data.index_copy_(3, torch.tensor(slots), pool.index_select(3, src).to("cpu"))

    def restore(self, pool: torch.Tensor, slots: list[int], blocks: list[int]) -> None:
        if slots:
            moved = self.data.index_select(3, torch.tensor(slots)).to(pool.device, non_blocking=True)
            pool.index_copy_(3, torch.tensor(blocks, device=pool.device), moved)
