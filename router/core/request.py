"""A request as the scheduler sees it: its tokens, how many of them are in the KV cache, its blocks.

Every step feeds a request `tokens[computed : computed + n]`; when that reaches the end of what is known
the shard samples the next token. A decode is simply the case n == 1. A soft-reset request keeps its tokens and
starts over from computed == 0, so its history becomes its prompt; an offloaded one keeps everything, its
blocks wait in swap slots until it is restored.
"""
import itertools
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

_ids = itertools.count(1)


class State(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    OFFLOADED = "offloaded"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    max_new_tokens: int
    priority: int = 0  # lower runs first; arrival order within a level
    stop_ids: frozenset = frozenset()  # sampling one of these ends the request (EOS, unless ignored)
    id: int = field(default_factory=lambda: next(_ids))
    arrival: float = field(default_factory=time.monotonic)
    generated: list[int] = field(default_factory=list)
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # names of its leading full, computed blocks
    reuse_prefix: bool = True
    on_shards: bool = False  # the shards know it (its first step since admission was sent)
    state: State = State.WAITING
    finish_reason: Optional[str] = None  # eos_token, stop_sequence or length once it finished by itself
    preemptions: int = 0  # soft resets
    offloads: int = 0
    swap_slots: list[int] = field(default_factory=list)  # where its blocks wait while offloaded
    window_blocks: list[int] = field(default_factory=list)  # hybrid models: the sliding layers' blocks
    window_base: int = 0  # logical index of window_blocks[0]
    after: Optional["Request"] = None  # another choice of the same prompt (n, best_of), whose prompt it shares
    speculate: bool = False  # may propose drafts (router/core/speculation.py): its sampling allows it

    @property
    def gated(self) -> bool:
        """A later choice of a prompt waits until the first choice's prompt is in the cache: admitted then, it
        finds the prompt's full blocks there (prefix caching) and computes only the partial last block."""
        lead = self.after
        return lead is not None and lead.state is not State.FINISHED and lead.computed < len(lead.prompt_ids)

    @property
    def rank(self) -> tuple:
        """Sort key: who goes first (admission, restore) and who is evicted last."""
        return self.priority, self.arrival, self.id

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.generated

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    @property
    def remaining(self) -> int:
        """Known tokens not yet in the cache; 1 for a request that is decoding."""
        return self.num_tokens - self.computed

    @property
    def is_decoding(self) -> bool:
        return self.state is State.RUNNING and self.remaining == 1 and self.computed > 0

    @property
    def is_done_generating(self) -> bool:
        return len(self.generated) >= self.max_new_tokens
