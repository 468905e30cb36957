"""The second allocator of hybrid models: sliding-window layers keep only the blocks a query can still see.

A query at position p attends to keys p - window + 1 .. p, so once a step's first query is at `start`, every
block whose tokens all lie before start - window + 1 is dead for the rest of the request: it goes back to the
pool before the step, and the blocks the step writes are appended. The request's window table therefore holds
logical blocks window_base .. window_base + len(window_blocks) - 1.

Pure Python (no torch, no grpc).
"""
from router.core.allocator import BlockAllocator
from router.core.request import Request


class WindowAllocator:
    def __init__(self, blocks: BlockAllocator, window: int):
        self.blocks = blocks
        self.window = window

    def plan(self, req: Request, start: int, n: int) -> tuple[int, int]:
        """(blocks to drop from the front, blocks to append) for computing tokens start .. start + n - 1."""
        bs = self.blocks.block_size
        keep_from = max(0, start - self.window + 1) // bs
        drop = min(len(req.window_blocks), max(0, keep_from - req.window_base))
        held = req.window_base + len(req.window_blocks)
        return drop, max(0, self.blocks.blocks_for(start + n) - held)

    def extra(self, req: Request, start: int, n: int) -> int:
        """Free window blocks the step needs beyond those it returns first (may be negative)."""
        drop, add = self.plan(req, start, n)
        return add - drop

    def room(self, req: Request, start: int, free: int) -> int:
        """Tokens from `start` that fit in the request's window table once dead blocks are dropped."""
        drop, _ = self.plan(req, start, 1)
        return max(0, (req.window_base + len(req.window_blocks) + drop + free) * self.blocks.block_size - start)

    def advance(self, req: Request, start: int, n: int) -> tuple[int, list[int]]:
        """Drops the dead blocks, appends what the step writes; returns (dropped count, new blocks)."""
        drop, add = self.plan(req, start, n)
        self.blocks.free(req.window_blocks[:drop])
        req.window_blocks = req.window_blocks[drop:]
        req.window_base += drop
        new = self.blocks.allocate(add)
        req.window_blocks.extend(new)
        return drop, new

    def release(self, req: Request) -> None:
        self.blocks.free(req.window_blocks)
        req.window_blocks, req.window_base = [], 0
