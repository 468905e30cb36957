"""How many prompt tokens a step may carry while requests decode, so that those requests' next token is not
held up by someone else's prompt for longer than the operator allows (`--prefill-step-ratio`).

A step that carries prompt tokens beside D decodes may take at most `ratio` times the step of the D decodes
alone. Both sides come from a cost model of the steps this server actually ran, refitted after every step
(older steps count less, so a busier machine or longer contexts shift it within a few dozen steps):

    decode-only step(D) ≈ base + per_decode · D                     (over decode-only steps)
    what prompt tokens add ≈ per_token · n + per_key · keys          (over steps that carried prompt tokens)

where a chunk of n tokens after `start` cached ones reads keys = n · (start + (n + 1) / 2): late chunks of a long
prompt cost more, as each of their tokens attends to everything before it. The step may then carry the largest n
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
    """Decayed least squares of y ≈ a·x1 + b·x2 (no intercept), both coefficients kept non-negative."""

    def __init__(self):
        self.s11 = self.s12 = self.s22 = self.s1y = self.s2y = 0.0

    def add(self, x1: float, x2: float, y: float) -> None:
        d = DECAY
        self.s11, self.s12, self.s22 = self.s11 * d + x1 * x1, self.s12 * d + x1 * x2, self.s22 * d + x2 * x2
        self.s1y, self.s2y = self.s1y * d + x1 * y, self.s2y * d + x2 * y

    def coefficients(self) -> Optional[tuple[float, float]]:
        if self.s11 <= 0:
            return None
        det = self.s11 * self.s22 - self.s12 * self.s12
        if det > 1e-9 * self.s11 * self.s22:
            a = (self.s1y * self.s22 - self.s2y * self.s12) / det
            b = (self.s2y * self.s11 - self.s1y * self.s12) / det
            if a >= 0 and b >= 0:
                return a, b
        fits = [(self.s1y / self.s11, 0.0)]  # one term alone, the one that fits best
        if self.s22 > 0:
            fits.append((0.0, self.s2y / self.s22))
        return min(fits, key=lambda ab: self._error(*ab))

    def _error(self, a: float, b: float) -> float:
        return a * a * self.s11 + 2 * a * b * self.s12 + b * b * self.s22 - 2 * (a * self.s1y + b * self.s2y)


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
        self._decodes = _Fit()  # decode-only steps: seconds ≈ base·1 + per_decode·D
        self._prompts = _Fit()  # steps with prompt tokens: seconds - decode-only step ≈ per_token·n + per_key·keys
        self._rough: Optional[float] = None  # seconds / n of a prompt step seen before any decode-only step

    def observe(self, decodes: int, chunks: Iterable[tuple[int, int]], seconds: float) -> None:
        """A step ran in `seconds`: `decodes` requests decoded and each (start, n) of `chunks` computed n prompt
        tokens after start."""
        chunks = list(chunks)
        tokens = sum(n for _, n in chunks)
        if not tokens:
            if decodes:
                self._decodes.add(1.0, decodes, seconds)
            return
        alone = self.decode_step(decodes)
        if alone is None:
            self._rough = seconds / tokens
            return
        self._prompts.add(tokens, sum(keys_read(s, n) for s, n in chunks), max(seconds - alone, 0.0))

    def calibrate(self, steps: Iterable[tuple[int, int, int, float]]) -> None:
        """Starts from steps timed at Warmup: (decodes, chunk start, chunk tokens, seconds) each."""
        for decodes, start, tokens, seconds in steps:
            self.observe(decodes, [(start, tokens)] if tokens else [], seconds)

    def decode_step(self, decodes: int) -> Optional[float]:
        """Predicted seconds of a step of `decodes` decodes alone; None before any was seen."""
        fit = self._decodes.coefficients()
        return None if fit is None else fit[0] + fit[1] * decodes

    def prompt_cost(self) -> Optional[tuple[float, float]]:
        """(seconds per prompt token, seconds per key read); until a fit exists, a whole prompt step's share."""
        fit = self._prompts.coefficients()
        if fit is not None and fit != (0.0, 0.0):
            return fit
        return None if self._rough is None else (self._rough, 0.0)

    def prompt_tokens(self, decodes: int, start: int = 0, queued: int = 0) -> Optional[int]:
        """The most prompt tokens a step beside `decodes` decodes may carry, for a chunk after `start` cached
        tokens, with `queued` requests not yet admitted; None: no bound (nothing decodes, or the model has not
        seen both kinds of step yet)."""
        alone, cost = self.decode_step(decodes), self.prompt_cost()
        if not decodes or alone is None or cost is None:
            return None
        ratio = self.ratio * (decodes + queued) / decodes
        room, (per_token, per_key) = (ratio - 1) * alone, cost
        # per_token·n + per_key·n·(start + (n + 1)/2) <= room: the positive root of a quadratic in n
        linear = per_token + per_key * (start + 0.5)
        if per_key > 0:
            n = (math.sqrt(linear * linear + 2 * per_key * room) - linear) / per_key
        else:
            n = room / linear if linear > 0 else math.inf
        return max(self.min_tokens, int(n)) if math.isfinite(n) else None
