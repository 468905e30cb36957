"""How many prompt tokens a step may carry while requests decode, so that those requests' next token is not
held up by someone else's prompt for longer than the operator allows (`--prefill-step-ratio`).

A step that carries prompt tokens beside D decodes may take at most `ratio` times the step of the D decodes
alone. Both sides come from a cost model of the steps this server actually ran, refitted after every step
(older steps count less, so a busier machine or longer contexts shift it within a few dozen steps):

    decode-only step(D)  ≈ base + per_decode · D         (least squares over decode-only steps)
    per prompt token     ≈ Σ (t - decode-only step(D)) / Σ n   (over steps that carried n prompt tokens)

so the step may carry n = (ratio - 1) · decode-only step(D) / per prompt token tokens, at least `min_tokens` (a
prompt always moves on). With nothing decoding there is nobody to hold up: prompts take the whole
--max-batch-prefill-tokens. The token budgets stay upper bounds either way. Pure Python: the scheduler, the
simulator and the tests use it as it is.
"""
from dataclasses import dataclass
from typing import Optional

DECAY = 0.97  # weight of a step seen k steps ago: DECAY**k (half-life ~23 steps)


@dataclass
class _Decayed:
    """Decayed sums of one least-squares fit of y ≈ a + b·x."""
    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0

    def add(self, x: float, y: float) -> None:
        for name in ("w", "x", "y", "xx", "xy"):
            setattr(self, name, getattr(self, name) * DECAY)
        self.w += 1
        self.x += x
        self.y += y
        self.xx += x * x
        self.xy += x * y

    def predict(self, x: float) -> Optional[float]:
        if self.w == 0:
            return None
        mean_x, mean_y = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mean_x * mean_x
        slope = max(0.0, (self.xy / self.w - mean_x * mean_y) / var) if var > 1e-9 else 0.0
        return max(0.0, mean_y + slope * (x - mean_x))  # one decode count seen so far: its mean time


class Pacer:
    def __init__(self, ratio: float, min_tokens: int = 16):
        if ratio <= 1:
            raise ValueError(f"a prefill step ratio must be above 1, not {ratio}")
        self.ratio = ratio
        self.min_tokens = min_tokens
        self._decodes = _Decayed()
        self._residual = 0.0  # decayed Σ (t - decode-only step), over steps with prompt tokens
        self._tokens = 0.0    # decayed Σ n, over the same steps
        self._rough = None    # t / n of the last prompt step seen before any decode-only step (an overestimate)

    def observe(self, decodes: int, prompt_tokens: int, seconds: float) -> None:
        """A step ran: `decodes` requests decoded and `prompt_tokens` prompt tokens were computed in `seconds`."""
        if prompt_tokens == 0:
            if decodes:
                self._decodes.add(decodes, seconds)
            return
        alone = self.decode_step(decodes)
        if alone is None:
            self._rough = seconds / prompt_tokens
            return
        self._residual = self._residual * DECAY + max(seconds - alone, 0.0)
        self._tokens = self._tokens * DECAY + prompt_tokens

    def decode_step(self, decodes: int) -> Optional[float]:
        """Predicted seconds of a step of `decodes` decodes alone; None before any was seen."""
        return self._decodes.predict(decodes)

    @property
    def per_prompt_token(self) -> Optional[float]:
        """Seconds a prompt token adds to a step: fitted, or until a fit exists, a whole prompt step's share."""
        return self._residual / self._tokens if self._tokens and self._residual > 0 else self._rough

    def prompt_tokens(self, decodes: int) -> Optional[int]:
        """The most prompt tokens a step beside `decodes` decodes may carry; None: no bound (nothing decodes,
        or the model has not seen both kinds of step yet)."""
        alone, per_token = self.decode_step(decodes), self.per_prompt_token
        if not decodes or alone is None or per_token is None:
            return None
        return max(self.min_tokens, int((self.ratio - 1) * alone / per_token))
