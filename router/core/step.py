"""What the scheduler decided for one step (each request's share, the blocks that move before it runs), and
what came back from running it.

Pure Python: the engine turns a Step into gRPC calls, the simulator and the trace read it as it is.
"""
from dataclasses import dataclass, field

from router.core.request import Request


@dataclass
class Entry:
    """One request's share of a step: tokens[start:start + num_tokens] (the last of them its drafts, if any),
    blocks appended first."""

    @property
    def input_ids(self) -> list[int]:
        known = self.request.tokens[self.start:self.start + self.num_tokens - len(self.drafts)]
        return known + self.drafts if self.drafts else known
    request: Request
    start: int
    num_tokens: int
    new_blocks: list[int]
    sample: bool
    first: bool
    decode: bool
    new_window_blocks: list[int] = field(default_factory=list)
    window_dropped: int = 0
    drafts: list[int] = field(default_factory=list)  # speculation: proposed tokens after the last known one


@dataclass
class Step:
    entries: list[Entry] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)   # soft reset
    offloaded: list[Request] = field(default_factory=list)
    restored: list[Request] = field(default_factory=list)
    to_cpu: list[tuple[int, int]] = field(default_factory=list)     # (device block, swap slot)
    to_device: list[tuple[int, int]] = field(default_factory=list)  # (swap slot, device block)
    tables: dict[int, list[int]] = field(default_factory=dict)      # block tables the shards rebind

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def chunks(self) -> list[tuple[int, int]]:
        """(start, tokens) of each prompt chunk in the step."""
        return [(e.start, e.num_tokens) for e in self.entries if not e.decode]

    @property
    def decodes(self) -> int:
        return sum(1 for e in self.entries if e.decode)

    @property
    def has_prefill(self) -> bool:
        return any(not e.decode for e in self.entries)

    @property
    def evicted(self) -> bool:
        return bool(self.preempted or self.offloaded)


@dataclass
class Outcome:
    """What running a step produced: the token sampled for each request that sampled, and how long it took. Stop
    sequences are not here: only the router's detokenizer can tell, and it reads the text while the next step
    runs (router/engine.py ends those requests with `Scheduler.finish`)."""
    tokens: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0  # how long the step took (0: not measured); the pacer learns from it
    more: dict[int, list[int]] = field(default_factory=dict)  # speculation: the tokens after each first one
