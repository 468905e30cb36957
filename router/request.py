"""A request as the scheduler sees it: its tokens, how many of them are in the KV cache, its blocks.

Every step feeds a request `tokens[computed : computed + n]`; when that reaches the end of what is known
the shard samples the next token. A decode is simply the case n == 1. A preempted request (soft reset)
keeps its tokens and starts over from computed == 0, so its history becomes its prompt.
"""
import itertools
import time
from dataclasses import dataclass, field
from enum import Enum

_ids = itertools.count(1)


class State(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    max_new_tokens: int
    priority: int = 0
    id: int = field(default_factory=lambda: next(_ids))
    arrival: float = field(default_factory=time.monotonic)
    generated: list[int] = field(default_factory=list)
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # names of its leading full, computed blocks
    reuse_prefix: bool = True
    on_shards: bool = False  # the shards know it (its first step since admission was sent)
    state: State = State.WAITING
    preemptions: int = 0

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
