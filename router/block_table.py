"""The router's book of the paged KV cache: which physical blocks are free and which request owns which.

Pure Python (no torch, no grpc) so the scheduler, its unit tests and the simulator all use this very code.
The shards hold the bytes; this table is the only place that decides where they go.
"""
from collections import deque


class OutOfBlocks(Exception):
    pass


class BlockTable:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def extra_blocks(self, held: int, num_tokens: int) -> int:
        """Blocks a request holding `held` blocks must add to hold num_tokens tokens."""
        return max(0, self.blocks_for(num_tokens) - held)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)
