"""What the router knows about a request beyond scheduling: sampling, stopping, text, timings, its stream."""
import asyncio
import time
from dataclasses import dataclass, field
from typing import Optional

from proto import generate_pb2 as pb
from router.core.request import Request
from router.detokenizer import Detokenizer
from router.grammar import Constraint

clock = time.monotonic  # every request timing reads it; tests replace it to drive a known timeline


@dataclass
class Token:
    id: int
    text: str
    logprob: float
    special: bool
    top_tokens: list["Token"] = field(default_factory=list)
    final: bool = False  # the request's last token (set when it is produced, whatever the reader's lag)


@dataclass
class Job:
    request: Request
    parameters: pb.SamplingParameters
    detokenizer: Detokenizer
    special_ids: frozenset
    seed: Optional[int] = None
    constraint: Optional[Constraint] = None  # constrained decoding: its grammar's matcher (router/grammar.py)
    tokens: list[Token] = field(default_factory=list)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    finish_reason: Optional[str] = None
    cancelled: bool = False
    prefill_logprobs: list[float] = field(default_factory=list)
    skipped_tokens: int = 0  # tokens speculation gave it beyond one a step (TGI's tgi_request_skipped_tokens)
    arrived_at: float = field(default_factory=lambda: clock())  # the HTTP request came in (before validation)
    queued_at: float = field(default_factory=lambda: clock())  # validated: it joins the queue
    scheduled_at: Optional[float] = None  # its first step was planned (TGI's batch_time; kept through resets)
    first_token_at: Optional[float] = None
    finished_at: Optional[float] = None

    @property
    def id(self) -> int:
        return self.request.id

    @property
    def cumulative_logprob(self) -> float:
        """How likely its text was: what best_of ranks choices by."""
        return sum(t.logprob for t in self.tokens)

    def on_scheduled(self) -> None:
        """Its queue time ends at its first step; a soft reset or a shard restart does not start it again."""
        if self.scheduled_at is None:
            self.scheduled_at = clock()

    def on_prefill(self, logprobs) -> None:
        """Prompt-token logprobs arrive chunk by chunk; a recomputation after a soft reset adds nothing."""
        room = len(self.request.prompt_ids) - len(self.prefill_logprobs)
        self.prefill_logprobs.extend(list(logprobs)[:max(0, room)])

    def on_token(self, g: pb.Generation, piece: str, last: bool = True) -> None:
        """Streams a token the scheduler has already applied (`piece`: the text it completed); the request's
        finish reason, if the token ended it, was decided there (`last`: it is the last token the step gave the
        request; a speculative step gives several)."""
        if self.first_token_at is None:
            self.first_token_at = clock()
        decode = self.detokenizer.tokenizer.decode
        top = [Token(t.token_id, decode([t.token_id]), t.logprob, t.token_id in self.special_ids)
               for t in g.top_tokens]
        token = Token(g.token_id, piece, g.logprob, g.token_id in self.special_ids, top)
        self.tokens.append(token)
        self.finish_reason = self.request.finish_reason if last else None
        token.final = self.finish_reason is not None
        self.events.put_nowait(("token", token))
        if self.finish_reason:
            self.finished_at = clock()
            self.events.put_nowait(("end", self))

    def fail(self, message: str) -> None:
        self.finish_reason = "error"
        self.finished_at = clock()
        self.events.put_nowait(("error", message))
