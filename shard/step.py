"""What one step asks of a shard, and what it gives back, as the runner sees them (server.py converts the
gRPC messages), so tests and benchmarks drive a Runner without building protos."""
from dataclasses import dataclass, field
from typing import Optional

from shard.sampling import Params


@dataclass
class Entry:
    """One request's share of a step: its next tokens, after `cached_tokens` already in the cache."""
    id: int
    input_ids: list[int]
    new_blocks: list[int] = field(default_factory=list)
    sample: bool = False
    cached_tokens: int = 0
    params: Optional[Params] = None  # a request's first entry only: the shard keeps them
    prompt_tokens: int = 0
    prefill_logprobs: bool = False
    new_window_blocks: list[int] = field(default_factory=list)
    window_dropped: int = 0
    allowed_tokens: bytes = b""  # constrained decoding: the bitmask of tokens it may sample (empty: any)
    drafts: int = 0  # speculation: the last `drafts` input ids are proposals to verify


@dataclass
class Sampled:
    id: int
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    more: list[tuple[int, float]] = field(default_factory=list)  # speculation: further tokens, (id, logprob)


@dataclass
class StepResult:
    generations: list[Sampled]
    prefill: list[tuple[int, list[float]]]  # (request id, logprobs of this chunk's prompt tokens)
    forward_ns: int
    compiled: bool = False  # the forward ran a graph compiled at Warmup (compiled.py)
