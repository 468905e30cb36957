"""Workloads and arrival processes shared by cb-bench (against a server), its in-process baselines and cb-sim.

A workload is a list of `Req`: what to send (token ids or text), how many prompt tokens that is, and how many
tokens to force out (EOS ignored), so every system under comparison does exactly the same work. Arrivals are
offsets in seconds from the start of a run, one per request, in submission order.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

# W64, the project's benchmark: 64 requests (seed 1234), prompts of 16-256 random token ids, 16-256 forced new
# tokens; 9,046 prompt and 8,571 output tokens. Replayed exactly, so every system does the same work.
DEFAULT_WORKLOAD = Path(__file__).resolve().parent / "data" / "w64.json"

# The worked example of continuous batching: 12 requests with outputs of 100 to 1,000 tokens on 4 slots, equal
# step cost. These lengths reproduce its every number: sum 4,250; static groups of 4 end at 1,000 + 700 + 500 =
# 2,200 steps (48% slot use, mean completion 1,633); FIFO list scheduling ends at 1,150 steps (92%, mean 635).
EXAMPLE_LENGTHS = [130, 310, 1000, 260, 130, 220, 230, 700, 370, 100, 500, 300]


@dataclass
class Req:
    id: int
    prompt_tokens: int
    max_new_tokens: int
    prompt_ids: Optional[list[int]] = None
    text: Optional[str] = None
    tokenized: Optional[list[int]] = None  # a text prompt's ids, for the in-process baselines only
    response_format: Optional[dict] = None  # OpenAI's, sent as is (bench/structured.py)

    @property
    def inputs(self) -> Union[str, list[int]]:
        """What goes into the request body's `inputs`: the token ids when known exactly, else the text."""
        return self.prompt_ids if self.prompt_ids is not None else self.text


def load_w64(path: Path = DEFAULT_WORKLOAD) -> list[Req]:
    """The W64 file, replayed exactly: its token ids and its forced output lengths."""
    reqs = json.loads(Path(path).read_text())["requests"]
    out = []
    for r in reqs:
        if not r["prompt_ids"] or int(r["max_new_tokens"]) < 1:
            raise ValueError(f"bad request in workload: id={r.get('id')}")
        out.append(Req(int(r["id"]), len(r["prompt_ids"]), int(r["max_new_tokens"]), prompt_ids=list(r["prompt_ids"])))
    return out


def random_workload(n: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0,
                    token_range: tuple[int, int] = (100, 49000)) -> list[Req]:
    """vLLM's `random` dataset: lengths uniform in [len * (1 - ratio), len * (1 + ratio)], random token ids."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("range_ratio must be in [0, 1)")
    rng = random.Random(seed)

    def draw(length: int) -> int:
        lo, hi = max(1, int(length * (1 - range_ratio))), max(1, int(length * (1 + range_ratio)))
        return rng.randint(lo, hi)

    out = []
    for i in range(n):
        p, m = draw(input_len), draw(output_len)
        out.append(Req(i, p, m, prompt_ids=[rng.randrange(*token_range) for _ in range(p)]))
    return out


def text_workload(path: Path, output_len: int, n: Optional[int] = None, tokenizer=None) -> list[Req]:
    """One prompt per non-empty line of a text file (cycled to `n` requests); sent as text. A tokenizer, when
    given, supplies the prompt lengths the report and the simulator need, and the ids the baselines run."""
    lines = [ln.strip() for ln in Path(path).read_text().splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"{path}: no prompts")
    n = n or len(lines)
    out = []
    for i in range(n):
        text = lines[i % len(lines)]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] if tokenizer is not None else None
        out.append(Req(i, len(ids) if ids is not None else 0, output_len, text=text, tokenized=ids))
    return out


GROUNDED = Path(__file__).resolve().parent / "data" / "grounded.json"


def grounded_workload(path: Path = GROUNDED, n: Optional[int] = None, tokenizer=None) -> list[Req]:
    """Requests that repeat or lightly edit a passage their prompt holds (where speculation pays), sent as text,
    each with its own max_new_tokens; cycled to `n` requests."""
    items = json.loads(Path(path).read_text())["requests"]
    out = []
    for i in range(n or len(items)):
        item = items[i % len(items)]
        ids = tokenizer(item["prompt"])["input_ids"] if tokenizer is not None else None
        out.append(Req(i, len(ids) if ids is not None else 0, item["max_new_tokens"], text=item["prompt"],
                       tokenized=ids))
    return out


QUALITY_TEXT = Path(__file__).resolve().parent / "data" / "quality.txt"


def shared_prefix_workload(docs: int, questions: int, doc_words: int = 200, max_new_tokens: int = 32,
                           seed: int = 0) -> list[Req]:
    """`docs` passages of `doc_words` words each (drawn with `seed` from quality.txt's words, so a seed's passages
    share no prefix with another seed's), each asked `questions` short questions: every prompt is a passage, then
    its question. Sent as text (a balancer routes on text), passage by passage in turn (d0 q0, d1 q0, ..., d0 q1,
    ...), so that round robin over an even number of replicas does not keep a passage on one replica by luck when
    `docs` is odd."""
    words = QUALITY_TEXT.read_text().split()
    rng = random.Random(seed)
    passages = [" ".join(rng.choice(words) for _ in range(doc_words)) for _ in range(docs)]
    out = []
    for q in range(questions):
        for d, passage in enumerate(passages):
            ask = " ".join(rng.choice(words) for _ in range(6))
            out.append(Req(len(out), 0, max_new_tokens, text=f"{passage}\n\nQuestion {q + 1}: {ask}?\nAnswer:"))
    return out


def token_ids(req: Req) -> list[int]:
    """The ids an in-process baseline feeds the model."""
    ids = req.prompt_ids if req.prompt_ids is not None else req.tokenized
    if ids is None:
        raise ValueError(f"request {req.id}: no token ids (a text workload needs a tokenizer)")
    return ids


def worked_example() -> list[Req]:
    """The worked example's 12 requests: 1-token prompts, output lengths 100..1,000, all waiting at t = 0."""
    return [Req(i, 1, m, prompt_ids=[100]) for i, m in enumerate(EXAMPLE_LENGTHS)]


def short_requests(n: int, seed: int = 0, prompt_len: int = 10, gen_range: tuple[int, int] = (10, 200)) -> list[Req]:
    """The rate sweep's requests: prompts of 10 tokens, generation lengths uniform in 10..200."""
    rng = random.Random(seed)
    return [Req(i, prompt_len, rng.randint(*gen_range)) for i in range(n)]


def parse_rate(text: Union[str, float]) -> float:
    s = str(text).strip().lower()
    return math.inf if s in ("inf", "infinity", "") else float(s)


def arrival_times(n: int, rate: float = math.inf, process: str = "poisson", seed: int = 0,
                  burstiness: float = 1.0) -> list[float]:
    """Offsets (s) of n arrivals. rate=inf: all at once. `fixed`: every 1/rate s. `poisson`: exponential gaps at
    `rate` (burstiness != 1 makes them gamma-distributed with the same mean, as `vllm bench serve` does)."""
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError("rate must be positive")
    if process == "fixed":
        return [i / rate for i in range(n)]
    if process != "poisson":
        raise ValueError(f"unknown arrival process {process!r} (poisson or fixed)")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


def describe(reqs: list[Req]) -> str:
    p = sum(r.prompt_tokens for r in reqs)
    m = sum(r.max_new_tokens for r in reqs)
    return f"{len(reqs)} requests, {p} prompt tokens, {m} output tokens"
