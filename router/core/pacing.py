"""How many prompt tokens a step may carry while requests decode, so that those requests' next token is not
held up by someone else's prompt for longer than the operator allows (`--prefill-step-ratio`).

A step that carries prompt tokens beside D decodes may take at most `ratio` times the step of the D decodes
alone. Both sides come from a cost model of the steps this server actually ran, refitted after every step
(older steps count less, so a busier machine or longer contexts shift it within a few dozen steps):

    decode-only step(D) ≈ base + per_decode · D                     (over decode-only steps)
    what prompt tokens add ≈ fixed + per_token · n + per_key · keys  (over steps that carried prompt tokens)

where a chunk of n tokens after `start` cached ones reads keys = n · (start + (n + 1) / 2): late chunks of a long
prompt cost more, as each of their tokens attends to everything before it; `fixed` is what any prompt chunk costs a
step (on CPU such a step is usually beyond the compiled sizes and runs eagerly: 16-32 tokens beside eight decodes
took 2.3-2.8x their step, not the 1.7x a fit without it predicted). The step may then carry the largest n
whose addition stays within (ratio - 1) · decode-only step(D), at least `min_tokens` (a prompt always moves on).
With nothing decoding there is nobody to hold up: prompts take the whole --max-batch-prefill-tokens. The token
budgets stay upper bounds either way.

The bound protects running streams from a prompt, not from a queue: with Q requests queued (not yet admitted)
beside D decoding, the ratio is scaled by (D + Q) / D, the requests waiting on this step per stream it stalls. A
long prompt beside eight streams is admitted at once and then moves at the ratio (nothing queued); a burst of sixty
prompts beside the four admitted first is not starved to spare those four a few milliseconds each (W64 after one
lone request: 525-575 chunks of ~16 tokens, its TTFT 2-4x, before this).

The model starts from Warmup's timed steps (the shards time decode-only and prompt steps of several sizes), not
from nothing: fitted only on the steps of one request, a decode-only step of 64 looked as cheap as a step of one.
Pure Python: the scheduler, the simulator and the tests use it as it is.
"""
import math
from typing import Iterable, Optional

DECAY = 0.97  # weight of a step seen k steps ago: DECAY**k (half-life ~23 steps)


class _Fit:
    """Decayed least squares of y ≈ Σ c_i·x_i over the caller's features, every coefficient kept non-negative: the
    best fit over the subsets of features whose own fit is (a handful of features, so every subset is tried)."""

    def __init__(self, features: int):
        self.a = [[0.0] * features for _ in range(features)]  # Σ x_i·x_j, decayed
        self.b = [0.0] * features                             # Σ x_i·y, decayed
        self._solved: Optional[tuple[Optional[list[float]]]] = None  # coefficients() until the next add

    def add(self, x: tuple[float, ...], y: float) -> None:
        self._solved = None
        for i, xi in enumerate(x):
            self.b[i] = self.b[i] * DECAY + xi * y
            for j, xj in enumerate(x):
                self.a[i][j] = self.a[i][j] * DECAY + xi * xj

    def coefficients(self) -> Optional[list[float]]:
        """Solved once per step seen (~90 us in Python), though every step asks several times."""
        if self._solved is None:
            self._solved = (self._best_fit(),)
        return self._solved[0]

    def _best_fit(self) -> Optional[list[float]]:
        k, best = len(self.b), None
        # the most features first, then the later ones: on a tie (too few steps seen to tell) a prompt's cost is
        # put on its tokens rather than on the step
        for subset in sorted(range(1, 1 << k), key=lambda s: (-bin(s).count("1"), -s)):
            used = [i for i in range(k) if subset >> i & 1]
            if any(self.a[i][i] <= 0 for i in used):
                continue
            solved = _solve([[self.a[i][j] for j in used] for i in used], [self.b[i] for i in used])
            if solved is None or min(solved) < 0:
                continue
            c = [0.0] * k
            for i, v in zip(used, solved):
                c[i] = v
            error = sum(c[i] * c[j] * self.a[i][j] for i in range(k) for j in range(k)) - 2 * sum(
                ci * bi for ci, bi in zip(c, self.b))
            if best is None or error < best[0] - 1e-12 * abs(best[0]):
                best = (error, c)
        return None if best is None else best[1]


def _solve(a: list[list[float]], b: list[float]) -> Optional[list[float]]:
    """a·x = b by Gaussian elimination; None when a is (nearly) singular."""
    n = len(b)
    m = [row[:] + [v] for row, v in zip(a, b)]
    scale = max(abs(m[i][i]) for i in range(n))
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-9 * scale:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


def pacer(ratio: float) -> Optional["Pacer"]:
    """The pacer for --prefill-step-ratio: None when it is 0 (off); a ratio in (0, 1] is refused."""
    return Pacer(ratio) if ratio else None


def keys_read(start: int, n: int) -> float:
    """Keys a chunk of n prompt tokens after `start` cached ones attends to, summed over its tokens."""
    return n * (start + (n + 1) / 2)


class Pacer:
    def __init__(self, ratio: float, min_tokens: int = 16):
        if ratio <= 1:
            raise ValueError(f"a prefill step ratio must be above 1, not {ratio}")
        self.ratio = ratio
        self.min_tokens = min_tokens
        self._decodes = _Fit(2)  # decode-only steps: seconds ≈ base·1 + per_decode·D
        # steps with prompt tokens: seconds - decode-only step ≈ fixed + per_token·n + per_key·keys
        self._prompts = _Fit(3)
        self._rough: Optional[float] = None  # seconds / n of a prompt step seen before any decode-only step

    def observe(self, decodes: int, chunks: Iterable[tuple[int, int]], seconds: float) -> None:
        """A step ran in `seconds`: `decodes` requests decoded and each (start, n) of `chunks` computed n prompt
        tokens after start."""
        chunks = list(chunks)
        tokens = sum(n for _, n in chunks)
        if not tokens:
            if decodes:
                self._decodes.add((1.0, decodes), seconds)
            return
        alone = self.decode_step(decodes)
        if alone is None:
            self._rough = seconds / tokens
            return
        self._prompts.add((1.0, tokens, sum(keys_read(s, n) for s, n in chunks)), max(seconds - alone, 0.0))

    def calibrate(self, steps: Iterable[tuple[int, int, int, float]]) -> None:
        """Starts from steps timed at Warmup: (decodes, chunk start, chunk tokens, seconds) each."""
        for decodes, start, tokens, seconds in steps:
            self.observe(decodes, [(start, tokens)] if tokens else [], seconds)

    def decode_step(self, decodes: int) -> Optional[float]:
        """Predicted seconds of a step of `decodes` decodes alone; None before any was seen."""
        fit = self._decodes.coefficients()
        return None if fit is None else fit[0] + fit[1] * decodes

    def prompt_cost(self) -> Optional[tuple[float, float, float]]:
        """(seconds any prompt tokens add to a step, per prompt token, per key read); until a fit exists, a whole
        prompt step's share per token."""
        fit = self._prompts.coefficients()
        if fit is not None and fit[1:] != [0.0, 0.0]:
            return fit[0], fit[1], fit[2]
        return None if self._rough is None else (0.0, self._rough, 0.0)

    def prompt_tokens(self, decodes: int, start: int = 0, queued: int = 0) -> Optional[int]:
        """The most prompt tokens a step beside `decodes` decodes may carry, for a chunk after `start` cached
        tokens, with `queued` requests not yet admitted; None: no bound (nothing decodes, or the model has not
        seen both kinds of step yet)."""
        alone, cost = self.decode_step(decodes), self.prompt_cost()
        if not decodes or alone is None or cost is None:
            return None
        ratio = self.ratio * (decodes + queued) / decodes
        fixed, per_token, per_key = cost
        room = (ratio - 1) * alone - fixed
        if room <= 0:
            return self.min_tokens
        # per_token·n + per_key·n·(start + (n + 1)/2) <= room: the positive root of a quadratic in n
        linear = per_token + per_key * (start + 0.5)
        if per_key > 0:
            n = (math.sqrt(linear * linear + 2 * per_key * room) - linear) / per_key
        else:
            n = room / linear if linear > 0 else math.inf
        return max(self.min_tokens, int(n)) if math.isfinite(n) else None
