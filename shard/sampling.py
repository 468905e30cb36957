"""Next-token choice per request: greedy rows in one argmax (on CPU, a batch of only greedy rows in one C pass per
row, paged_kernel.greedy), sampled rows each with their own generator.

A sampled token's generator is seeded from (request seed, position), so the same seed gives the same text
whatever else shares the batch and even after the request was preempted and recomputed.

Sampling is total: no parameter the router accepts can make it raise (a raise fails every request in the
batch). A temperature below GREEDY_BELOW is greedy, NaN logits count as impossible and infinite ones as the
largest float, and a row left with no possible token falls back to its argmax.
"""
from dataclasses import dataclass

import torch

from shard import paged_kernel

GREEDY_BELOW = 1e-5  # vLLM's epsilon (router/api/validation.py uses the same): dividing by less overflows


@dataclass
class Params:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    do_sample: bool = False
    seed: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    typical_p: float = 1.0
    top_n_tokens: int = 0

    @property
    def greedy(self) -> bool:
        return not self.do_sample or not self.temperature >= GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0


def apply_penalties(logits: torch.Tensor, history: torch.Tensor, p: Params) -> torch.Tensor:
    """TGI's repetition penalty (divide positive, multiply negative) and OpenAI's frequency penalty."""
    if p.repetition_penalty != 1.0:
        seen = logits[history]
        logits = logits.index_put((history,), torch.where(seen > 0, seen / p.repetition_penalty,
                                                           seen * p.repetition_penalty))
    if p.frequency_penalty != 0.0:
        counts = torch.bincount(history, minlength=logits.shape[-1]).to(logits.dtype)
        logits = logits - p.frequency_penalty * counts
    return logits


def warp(logits: torch.Tensor, p: Params) -> torch.Tensor:
    """Temperature, top-k, top-p and typical-p, in HF's order, on one row of float32 logits."""
    logits = finite(logits / p.temperature)
    if p.top_k > 0:
        kth = torch.topk(logits, min(p.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= p.top_p
        logits = logits.index_put((order[drop],), torch.tensor(float("-inf")))
    if p.typical_p < 1.0:
        logprobs = logits.log_softmax(-1)
        entropy = -(logprobs.exp() * logprobs).nansum()
        surprise = (-logprobs - entropy).abs()
        sorted_surprise, order = torch.sort(surprise)
        cum = logprobs.exp()[order].cumsum(-1)
        keep = int((cum < p.typical_p).sum()) + 1
        logits = logits.index_put((order[keep:],), torch.tensor(float("-inf")))
    return logits


def finite(logits: torch.Tensor) -> torch.Tensor:
    """NaN → -inf (impossible), +inf → the largest float: log_softmax of a row then has no NaN unless every
    token is impossible."""
    return logits.nan_to_num(nan=float("-inf"), posinf=torch.finfo(logits.dtype).max, neginf=float("-inf"))


def penalize(logits: torch.Tensor, params: list[Params], histories: list) -> torch.Tensor:
    """Penalties on the rows that ask for them; a penalty that would leave no token possible is ignored."""
    for i, p in enumerate(params):
        if p.penalized:
            row = finite(apply_penalties(logits[i], histories[i], p))
            if bool(row.isfinite().any()):
                logits[i] = row
    return logits


def constrain(logits: torch.Tensor, masks: list[bytes]) -> torch.Tensor:
    """Constrained decoding: a row with a bitmask (proto StepEntry.allowed_tokens) keeps only the tokens it
    allows; the others become impossible (-inf) before penalties, warpers and sampling see them."""
    rows = [i for i, m in enumerate(masks) if m]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    bits = torch.arange(32, dtype=torch.int32)
    for i in rows:
        words = torch.frombuffer(bytearray(masks[i]), dtype=torch.int32)
        allowed = ((words[:, None] >> bits) & 1).flatten()[:vocab].to(torch.bool)
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[:allowed.shape[0]] = allowed
        logits[i].masked_fill_(~keep.to(logits.device), float("-inf"))
    return logits


def verify(logits: torch.Tensor, drafts: list[int], p: Params, position: int) -> list[tuple[int, float]]:
    """Speculation (router/core/speculation.py): rows [k + 1, V] scored the request's last token and its k drafts;
    returns the tokens it produces, (token, logprob) each: the drafts it accepts, then one more. Greedy accepts a
    draft that is the argmax, so the text is what it would be without drafts. Sampling accepts draft d with
    probability p(d) and otherwise samples from p without d (the rule for a draft proposed with certainty), so
    each token has the distribution it would have without drafts; `position` seeds token i's draws as sample_one
    does (the position of the first token produced)."""
    out = []
    for i, row in enumerate(logits):
        logprobs = finite(row.float()).log_softmax(-1)
        if p.greedy:
            token = int(logprobs.argmax())
        else:
            warped = finite(warp(row.float(), p)).log_softmax(-1)
            if bool(warped.isfinite().any()):
                logprobs = warped
            gen = generator(p, position + i, row.device)
            if i < len(drafts):
                d = drafts[i]
                if float(torch.rand((), generator=gen, device=row.device)) < float(logprobs[d].exp()):
                    out.append((d, float(logprobs[d])))
                    continue
                rest = logprobs.clone()
                rest[d] = float("-inf")
                token = int(torch.multinomial(rest.exp(), 1, generator=gen)) if bool(rest.isfinite().any()) else d
            else:
                token = int(torch.multinomial(logprobs.exp(), 1, generator=gen))
        out.append((token, float(logprobs[token])))
        if i >= len(drafts) or token != drafts[i]:
            break
    return out


def generator(p: Params, position: int, device: torch.device) -> torch.Generator:
    """The draws for the token at `position`: seeded from (seed, position) alone."""
    return torch.Generator(device=device).manual_seed((p.seed * 1_000_003 + position) % (2**63))


def sample_one(logprobs: torch.Tensor, p: Params, position: int) -> int:
    return int(torch.multinomial(logprobs.exp(), 1, generator=generator(p, position, logprobs.device)))


def sample(logits: torch.Tensor, params: list[Params], histories: list, positions: list[int]):
    """logits [S, V] -> list of (token, logprob, [(top token, logprob)]); logprobs are those of the
    distribution the token was drawn from (after penalties and warpers)."""
    if all(p.greedy and not p.top_n_tokens and not p.penalized for p in params):
        fast = paged_kernel.greedy(logits)  # None: no kernel here, not a CPU float32 or bf16 row, or a max inf
        if fast is not None:
            return [(token, logprob, []) for token, logprob in zip(*fast)]
    logits = penalize(finite(logits.float()), params, histories)
    logprobs = logits.log_softmax(-1)
    greedy = logits.argmax(-1)
    tokens, chosen = greedy.tolist(), logprobs.gather(1, greedy[:, None])[:, 0].tolist()  # one op for every row
    out = []
    for i, p in enumerate(params):
        if p.greedy and not p.top_n_tokens:
            out.append((tokens[i], chosen[i], []))
            continue
        row = logprobs[i]
        token = tokens[i]
        if not p.greedy:
            warped = finite(warp(logits[i], p)).log_softmax(-1)
            if bool(warped.isfinite().any()):  # else every token was masked: the row's argmax
                row = warped
                token = sample_one(row, p, positions[i])
        top = []
        if p.top_n_tokens:
            values, indices = torch.topk(row, min(p.top_n_tokens, row.shape[-1]))
            top = list(zip(indices.tolist(), values.tolist()))
        out.append((token, float(row[token]), top))
    return out
