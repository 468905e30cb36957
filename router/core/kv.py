"""The KV manager: the one place that knows the router's pools and what each request holds in them.

- the device pool, one block table per request (`Request.blocks`), with prefix caching: a full block is named
  by a chained content hash (its tokens and the name of the block before, so equal names mean equal prefixes),
  and a new request whose tokens start with named blocks shares them (reference counts) instead of computing
  them again;
- on hybrid models, the sliding-window layers' pool (window.py);
- the host swap pool, where offloaded requests' blocks wait (`Request.swap_slots`).

The scheduler asks it questions (how many tokens fit, can this request grow, be offloaded, come back) and tells
it what to do (share a hit, grow, offload, restore, free); it never touches an allocator itself.
Pure Python (no torch, no grpc).
"""
import hashlib
from array import array
from dataclasses import dataclass, field
from typing import Optional

from router.core.allocator import BlockAllocator
from router.core.request import Request
from router.core.window import WindowAllocator


def chain_hash(previous: Optional[bytes], tokens: list[int]) -> bytes:
    h = hashlib.blake2b(previous or b"", digest_size=16)
    h.update(array("I", tokens).tobytes())
    return h.digest()


@dataclass
class Hit:
    """The cached blocks holding the longest run of full blocks that starts a prompt, and their names."""
    blocks: list[int] = field(default_factory=list)
    names: list[bytes] = field(default_factory=list)


@dataclass
class Free:
    """Free blocks as a plan sees them before it commits anything (window: None without a window pool)."""
    pool: int
    window: Optional[int]


@dataclass
class Growth:
    """What one step adds to a request's tables."""
    new_blocks: list[int]
    window_dropped: int = 0
    new_window_blocks: list[int] = field(default_factory=list)


class KVManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False, swap_blocks: int = 0,
                 window: int = 0, window_blocks: int = 0):
        self.block_size = block_size
        self.pool = BlockAllocator(num_blocks, block_size)
        self.window = WindowAllocator(BlockAllocator(window_blocks, block_size), window) if window else None
        offload = self.can_offload_model(window)
        self.prefix_caching = prefix_caching and offload
        self.swap = BlockAllocator(swap_blocks, block_size) if swap_blocks and offload else None
        self.prefix_lookups = 0
        self.prefix_hit_blocks = 0

    @staticmethod
    def can_offload_model(window: int) -> bool:
        """Hybrid models (a sliding window) neither offload nor share prefixes: their window pool has no swap
        slots, and their window layers keep no prefix to share. Their evictions are soft resets."""
        return not window

    # Questions (nothing changes) ---------------------------------------------------------------------------

    def free(self) -> Free:
        return Free(self.pool.num_free, self.window.blocks.num_free if self.window else None)

    def room(self, req: Request, free: Optional[Free] = None) -> int:
        """Tokens a running request can add to its cache from where it stands."""
        free = free or self.free()
        pool = (len(req.blocks) + free.pool) * self.block_size - req.computed
        return min(pool, self._window_room(req, req.computed, free.window))

    def admission_room(self, req: Request, hit: Hit, free: Free) -> int:
        """Tokens after its cached prefix that a waiting request could compute if admitted with `hit`."""
        cached = len(hit.blocks) * self.block_size
        pool = (free.pool - self.pool.free_among(hit.blocks)) * self.block_size
        return min(pool, self._window_room(req, cached, free.window))

    def take(self, free: Free, req: Request, hit: Hit, n: int) -> None:
        """Books in `free` what admitting `req` with `hit` and computing n more tokens would use."""
        cached = len(hit.blocks) * self.block_size
        free.pool -= self.pool.extra_blocks(len(hit.blocks), cached + n) + self.pool.free_among(hit.blocks)
        if free.window is not None:
            free.window -= self.window.extra(req, cached, n)

    def can_grow(self, req: Request) -> bool:
        """Whether a running request can add one token right now."""
        if self.pool.extra_blocks(len(req.blocks), req.computed + 1) > self.pool.num_free:
            return False
        return self.window is None or self.window.extra(req, req.computed, 1) <= self.window.blocks.num_free

    def can_offload(self, req: Request) -> bool:
        return self.swap is not None and len(req.blocks) <= self.swap.num_free

    def can_restore(self, req: Request, n: int) -> bool:
        """Whether an offloaded request's blocks, and what its next n tokens add, fit the pool."""
        held = len(req.swap_slots)
        return held + self.pool.extra_blocks(held, req.computed + n) <= self.pool.num_free

    def lookup(self, req: Request) -> Hit:
        """Its prompt's leading cached blocks (the last token is always computed, so it is not looked up). A later
        choice of a prompt (n, best_of) takes them from its first choice's table, with or without prefix caching,
        so the prompt is computed once either way (not on hybrid models: their window layers share nothing)."""
        hit = Hit()
        if not req.reuse_prefix or self.window is not None:
            return hit
        lead = req.after
        if lead is not None and lead.blocks and lead.computed >= len(lead.prompt_ids) == len(req.prompt_ids):
            n = (len(req.prompt_ids) - 1) // self.block_size  # full blocks of prompt tokens only, never generated
            return Hit(list(lead.blocks[:n]), list(lead.hashes[:n]) if self.prefix_caching else [])
        if not self.prefix_caching:
            return hit
        tokens, bs = req.tokens[:req.num_tokens - 1], self.block_size
        for i in range(len(tokens) // bs):
            name = chain_hash(hit.names[-1] if hit.names else None, tokens[i * bs:(i + 1) * bs])
            block = self.pool.named(name)
            if block is None:
                break
            hit.blocks.append(block)
            hit.names.append(name)
        return hit

    # Orders ------------------------------------------------------------------------------------------------

    def share(self, req: Request, hit: Hit) -> None:
        """Admission: the request starts its table with the hit's blocks, already computed."""
        self.pool.share(hit.blocks)
        req.blocks, req.hashes, req.computed = list(hit.blocks), list(hit.names), len(hit.blocks) * self.block_size
        if req.reuse_prefix and (self.prefix_caching or req.after is not None):
            self.prefix_lookups += 1
            self.prefix_hit_blocks += len(hit.blocks)

    def grow(self, req: Request, n: int) -> Growth:
        """Gives the request the blocks its next n tokens need and names the blocks those tokens fill (their
        bytes are written during this very step, before any later step can read them)."""
        growth = Growth(self.pool.allocate(self.pool.extra_blocks(len(req.blocks), req.computed + n)))
        req.blocks.extend(growth.new_blocks)
        if self.window is not None:
            growth.window_dropped, growth.new_window_blocks = self.window.advance(req, req.computed, n)
        self._name_full_blocks(req, min(req.computed + n, req.num_tokens))  # never drafts: they may be rejected
        return growth

    def offload(self, req: Request) -> list[tuple[int, int]]:
        """Its blocks go to swap slots and back to the pool; returns (device block, swap slot) pairs to copy."""
        req.swap_slots = self.swap.allocate(len(req.blocks))
        moves = list(zip(req.blocks, req.swap_slots))
        self.pool.free(req.blocks)
        req.blocks = []
        return moves

    def restore(self, req: Request) -> list[tuple[int, int]]:
        """Fresh device blocks for its swap slots; returns (swap slot, device block) pairs to copy."""
        req.blocks = self.pool.allocate(len(req.swap_slots))
        moves = list(zip(req.swap_slots, req.blocks))
        self.swap.free(req.swap_slots)
        req.swap_slots = []
        if self.prefix_caching:
            for block, name in zip(req.blocks, req.hashes):
                self.pool.name(block, name)
        return moves

    def release(self, req: Request) -> None:
        """Returns everything the request holds, in every pool."""
        self.pool.free(req.blocks)
        req.blocks = []
        if self.swap is not None:
            self.swap.free(req.swap_slots)
        req.swap_slots = []
        if self.window is not None:
            self.window.release(req)

    def forget(self) -> None:
        """After a failed step the cache's bytes cannot be trusted: no block keeps a name."""
        self.pool.forget()

    # -------------------------------------------------------------------------------------------------------

    def _window_room(self, req: Request, start: int, free: Optional[int]) -> int:
        """Tokens from `start` the window pool can take (unbounded without one)."""
        return 1 << 62 if self.window is None else self.window.room(req, start, free)

    def _name_full_blocks(self, req: Request, computed: int) -> None:
        if not self.prefix_caching:  # names serve only lookups (and re-naming restored blocks)
            return
        bs = self.block_size
        while len(req.hashes) < min(computed // bs, len(req.blocks)):
            i = len(req.hashes)
            name = chain_hash(req.hashes[-1] if req.hashes else None, req.tokens[i * bs:(i + 1) * bs])
            self.pool.name(req.blocks[i], name)
            req.hashes.append(name)
