"""Hands out the blocks of one pool: which are free, how many users each has, which content each holds.

A block whose last user leaves keeps its content name (prefix caching, see kv.py): it joins the free list in
least-recently-used order and loses its name only when an allocation takes it. The swap pool and the
sliding-window pool are allocators of the same kind, whose blocks are simply never named.

Pure Python (no torch, no grpc): the shards hold the bytes; the router decides where they go.
"""
from collections import OrderedDict
from typing import Optional


class OutOfBlocks(Exception):
    pass


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks
        self._name: dict[int, bytes] = {}    # block -> name of its content
        self._block: dict[bytes, int] = {}   # name -> block

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take, including named blocks nobody uses (they are evicted on demand)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens."""
        return ceil_div(num_tokens, self.block_size)

    def extra_blocks(self, held: int, num_tokens: int) -> int:
        """Blocks a table of `held` blocks must add to hold num_tokens tokens."""
        return max(0, self.blocks_for(num_tokens) - held)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            name = self._name.pop(block, None)
            if name is not None:
                del self._block[name]
            self._refs[block] = 1
            out.append(block)
        return out

    def free(self, blocks: list[int]) -> None:
        """Drops one reference to each block; unreferenced blocks become free (most recently used last)."""
        for block in blocks:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None

    def share(self, blocks: list[int]) -> None:
        """Takes one more reference to each block (a prefix cache hit)."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1

    def free_among(self, blocks: list[int]) -> int:
        """How many of these blocks nobody uses (sharing them takes them off the free list)."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def named(self, name: bytes) -> Optional[int]:
        """The block holding the content called `name`, if any."""
        return self._block.get(name)

    def name(self, block: int, name: bytes) -> None:
        """Names a full, computed block (unless that content is held by another block already)."""
        if block not in self._name and name not in self._block:
            self._name[block] = name
            self._block[name] = block

    def forget(self) -> None:
        """No block keeps a name (after a failed step the bytes cannot be trusted)."""
        self._name.clear()
        self._block.clear()
