"""How long one step takes: a fixed overhead + a cost per prompt token computed + per decoding request + per KV
token read. Calibrated from a router trace (`cb-launcher --trace-file`, e.g. during a `cb-bench` run) by least
squares over the measured time between consecutive steps, or given by hand.

The features of a step come from its entries alone, `(start, num_tokens)` per request, so a live trace line and
a simulated `Step` are measured by the same function.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Optional

FEATURES = ("overhead_s", "per_prefill_token_s", "per_decode_s", "per_kv_token_s")


def step_features(entries: Iterable[tuple[int, int]]) -> tuple[float, int, int, int]:
    """(1, prompt tokens, decoding requests, KV tokens read) of a step given (start, num_tokens) per entry. A
    decode is one token on top of a non-empty cache; every entry reads the cache it extends, new tokens included."""
    prefill = decodes = kv = 0
    for start, num in entries:
        if num == 1 and start > 0:
            decodes += 1
        else:
            prefill += num
        kv += start + num
    return 1.0, prefill, decodes, kv


@dataclass
class CostModel:
    overhead_s: float = 1.0
    per_prefill_token_s: float = 0.0
    per_decode_s: float = 0.0
    per_kv_token_s: float = 0.0
    source: str = "unit steps"
    fit: dict = field(default_factory=dict)

    @classmethod
    def steps(cls) -> "CostModel":
        """Every step costs 1: times are then in steps (the worked example's 'equal step cost')."""
        return cls()

    @property
    def is_steps(self) -> bool:
        return (self.overhead_s, self.per_prefill_token_s, self.per_decode_s, self.per_kv_token_s) == (1.0, 0, 0, 0)

    @property
    def coefficients(self) -> tuple[float, float, float, float]:
        return self.overhead_s, self.per_prefill_token_s, self.per_decode_s, self.per_kv_token_s

    def time(self, features: tuple[float, int, int, int]) -> float:
        return sum(c * x for c, x in zip(self.coefficients, features))

    def step_time(self, entries: Iterable[tuple[int, int]]) -> float:
        return self.time(step_features(entries))

    def describe(self) -> str:
        if self.is_steps:
            return "equal step cost (1 step each)"
        return (f"{self.overhead_s * 1e3:.2f} ms/step + {self.per_prefill_token_s * 1e6:.1f} µs/prompt token + "
                f"{self.per_decode_s * 1e6:.1f} µs/decode + {self.per_kv_token_s * 1e9:.1f} ns/KV token "
                f"({self.source})")

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> "CostModel":
        data = json.loads(Path(path).read_text())
        data = data.get("cost_model", data)  # a cb-bench result embeds one
        return cls(**{k: data[k] for k in (*FEATURES, "source", "fit") if k in data})


def read_trace(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def timed_steps(lines: list[dict]) -> list[tuple[tuple[float, int, int, int], float]]:
    """(features, seconds) for every traced step whose duration is known: the time to the next line, skipping
    steps that scheduled nothing and gaps in which the router may have sat idle waiting for work."""
    live: set[int] = set()
    out = []
    for k, line in enumerate(lines):
        live |= {a["id"] for a in line["arrivals"]}
        live -= {i for i, _ in line["finished"]}
        if k + 1 >= len(lines) or not line["entries"]:
            continue
        nxt = lines[k + 1]
        still = live - {i for i, _ in nxt["finished"]}
        if not still:  # everything retired before the next step: the router may have waited for arrivals
            continue
        feats = step_features((s, n) for _, s, n, _ in line["entries"])
        out.append((feats, nxt["time"] - line["time"]))
    return out


def _solve(rows: list[tuple], ys: list[float], cols: list[int]) -> Optional[list[float]]:
    """Least squares on a subset of the columns (normal equations, tiny and dependency-free)."""
    import numpy as np
    a = np.array([[r[c] for c in cols] for r in rows], dtype=float)
    scale = np.maximum(np.abs(a).max(axis=0), 1e-12)
    coef, *_ = np.linalg.lstsq(a / scale, np.array(ys), rcond=None)
    coef = coef / scale
    return None if (coef < 0).any() else list(coef)


def calibrate(lines: list[dict], source: str = "trace") -> CostModel:
    """Non-negative least squares over the four terms (exhaustive over which terms are kept: four columns)."""
    data = timed_steps(lines)
    if len(data) < 8:
        raise ValueError(f"only {len(data)} timed steps in the trace: too few to calibrate")
    rows, ys = [f for f, _ in data], [t for _, t in data]
    best, best_err = None, float("inf")
    for k in range(4, 0, -1):
        for cols in itertools.combinations(range(4), k):
            coef = _solve(rows, ys, list(cols))
            if coef is None:
                continue
            full = [0.0] * 4
            for c, v in zip(cols, coef):
                full[c] = v
            err = sum((sum(a * b for a, b in zip(full, r)) - y) ** 2 for r, y in zip(rows, ys))
            if err < best_err:
                best, best_err = full, err
    model = CostModel(*best, source=source)
    pred = [model.time(r) for r in rows]
    mean = sum(ys) / len(ys)
    ss_tot = sum((y - mean) ** 2 for y in ys) or 1e-30
    model.fit = {"steps": len(ys), "measured_s": sum(ys), "fitted_s": sum(pred), "r2": 1 - best_err / ss_tot,
                 "mean_abs_pct_err": 100 * sum(abs(p - y) / y for p, y in zip(pred, ys) if y > 0) / len(ys)}
    return model
