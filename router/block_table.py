"""The router's book of the paged KV cache: which physical blocks are free, who shares which, what they hold.

Prefix caching: a full block is named by a chained content hash (its tokens and the hash of the block before,
so equal hashes mean equal prefixes, across processes too). A new request whose tokens start with named blocks
shares them (reference counts) instead of recomputing them. A block whose last user leaves keeps its name and
its bytes: it joins the free list in least-recently-used order and is evicted (renamed) only when an allocation
needs it.

Pure Python (no torch, no grpc) so the scheduler, its unit tests and the simulator all use this very code.
The shards hold the bytes; this table is the only place that decides where they go.
"""
import hashlib
from array import array
from collections import OrderedDict
from typing import Optional


class OutOfBlocks(Exception):
    pass


def chain_hash(previous: Optional[bytes], tokens: list[int]) -> bytes:
    h = hashlib.blake2b(previous or b"", digest_size=16)
    h.update(array("I", tokens).tobytes())
    return h.digest()


class BlockTable:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks
        self._name: dict[int, bytes] = {}    # block -> hash of its content
        self._block: dict[bytes, int] = {}   # hash -> block

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take, including cached blocks nobody uses (they are evicted on demand)."""
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

    def lookup(self, tokens: list[int]) -> tuple[list[int], list[bytes]]:
        """The cached blocks (and their names) holding the longest run of full blocks that starts `tokens`."""
        blocks, names = [], []
        if not self.prefix_caching:
            return blocks, names
        bs = self.block_size
        for i in range(len(tokens) // bs):
            name = chain_hash(names[-1] if names else None, tokens[i * bs:(i + 1) * bs])
            block = self._block.get(name)
            if block is None:
                break
            blocks.append(block)
            names.append(name)
        return blocks, names

    def free_among(self, blocks: list[int]) -> int:
        return sum(1 for b in blocks if self._refs[b] == 0)

    def share(self, blocks: list[int]) -> None:
        """Takes one more reference to each block (a cache hit)."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1

    def name(self, block: int, name: bytes) -> None:
        """Names a full, computed block so later requests can share it (unless its content is cached already)."""
        if self.prefix_caching and block not in self._name and name not in self._block:
            self._name[block] = name
            self._block[name] = block

    def forget(self) -> None:
        """After a failed step the cache's bytes cannot be trusted: no block keeps a name."""
        self._name.clear()
        self._block.clear()
