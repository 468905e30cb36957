"""Prompt-lookup (n-gram) speculation, `--speculate N`: a decoding request whose last tokens occurred earlier in
its own context (prompt and output so far) proposes the tokens that followed them there, up to N. The step feeds
them after its last token, the shard verifies them in the same forward pass (shard/sampling.py `verify`: greedy
keeps the longest run the model agrees with; sampling uses the standard rejection rule, so the distribution is
unchanged) and returns every token it accepted plus the next one; the scheduler then takes the request's cache
back to what was accepted (the rejected drafts' KV is simply overwritten later).

At batch one a CPU step is bound by reading the weights, so a few more query tokens cost little; a batch of many
requests is bound by arithmetic, where drafts cost about what they save: requests propose only while at most
MAX_BATCH decode. A request whose drafts keep failing stops proposing for a while (its acceptance rate, a
moving average, below MIN_RATE), then tries again. Pure Python, as the scheduler.
"""
from dataclasses import dataclass, field

from router.core.request import Request

NGRAMS = (3, 2)  # suffix lengths looked up, longest first
MAX_BATCH = 4  # decoding requests at most in a step where drafts are proposed
MIN_RATE = 0.3  # accepted / proposed, as a moving average, below which a request rests
REST_STEPS = 16  # steps a request rests before it proposes again
SMOOTHING = 0.5  # weight of the latest verification in the moving average


@dataclass
class _Context:
    """A request's n-gram index: each n-gram's latest end position with a known continuation."""
    index: dict[tuple, int] = field(default_factory=dict)
    indexed: int = 0  # tokens[:indexed] are indexed (as n-gram ends)
    rate: float = 1.0
    rest: int = 0


class Speculator:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.contexts: dict[int, _Context] = {}
        self.proposed = 0  # tokens proposed and verified, for metrics
        self.accepted = 0

    def propose(self, req: Request, decodes: int, room: int) -> list[int]:
        """Up to min(max_tokens, room) tokens that followed the latest earlier occurrence of the request's last
        n-gram; none while more than MAX_BATCH requests decode, or while the request rests."""
        limit = min(self.max_tokens, room)
        if limit <= 0 or decodes > MAX_BATCH:
            return []
        ctx = self.contexts.setdefault(req.id, _Context())
        if ctx.rest > 0:
            ctx.rest -= 1
            return []
        tokens = req.tokens
        last = len(tokens) - 1
        for end in range(ctx.indexed, last):  # every n-gram ending before the last token has a continuation
            for n in NGRAMS:
                if end + 1 >= n:
                    ctx.index[tuple(tokens[end + 1 - n:end + 1])] = end
        ctx.indexed = max(ctx.indexed, last)
        for n in NGRAMS:
            if last + 1 >= n:
                end = ctx.index.get(tuple(tokens[last + 1 - n:]))
                if end is not None:
                    return tokens[end + 1:end + 1 + limit]
        return []

    def observe(self, req: Request, proposed: int, accepted: int) -> None:
        """A verification's result: the request's acceptance rate moves, and it rests when the rate is low."""
        self.proposed += proposed
        self.accepted += accepted
        ctx = self.contexts.get(req.id)
        if ctx is None or not proposed:
            return
        ctx.rate = (1 - SMOOTHING) * ctx.rate + SMOOTHING * accepted / proposed
        if ctx.rate < MIN_RATE:
            ctx.rest, ctx.rate = REST_STEPS, MIN_RATE  # after resting, one poor verification rests it again

    def forget(self, req: Request) -> None:
        self.contexts.pop(req.id, None)
