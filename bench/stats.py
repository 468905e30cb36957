"""Per-request records → the numbers a benchmark reports (the same ones `vllm bench serve` prints).

A record is a dict: id, prompt_tokens, max_new_tokens, tokens (received), ttft (s), itl (list of s), e2e (s),
error (None or "type: message"), generated_tokens (from the final details, when known). The live client, the
in-process baselines and the simulator all produce records, so all of them are summarized by this one code.
"""
from __future__ import annotations

import math
from typing import Optional

METRICS = ("ttft", "tpot", "itl", "e2el")
LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E"}


def new_record(req, start: Optional[float] = None, **extra) -> dict:
    """An empty record for a request (a bench.workloads.Req) that starts at `start` (s into the run)."""
    return {"id": req.id, "prompt_tokens": req.prompt_tokens, "max_new_tokens": req.max_new_tokens, "tokens": 0,
            "ttft": None, "itl": [], "e2e": None, "start": start, "finish_reason": None, "generated_tokens": None,
            "error": None, **extra}


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), so p50 of an even list is the midpoint."""
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def tpot(rec: dict) -> Optional[float]:
    """Time per output token after the first: (e2e - ttft) / (tokens - 1)."""
    if rec.get("error") is None and rec.get("ttft") is not None and rec["tokens"] > 1:
        return (rec["e2e"] - rec["ttft"]) / (rec["tokens"] - 1)
    return None


def samples(recs: list[dict], metric: str) -> list[float]:
    """All samples of one metric in seconds: one per request, except ITL (one per token gap)."""
    ok = [r for r in recs if r.get("error") is None]
    if metric == "ttft":
        return [r["ttft"] for r in ok if r.get("ttft") is not None]
    if metric == "itl":
        return [x for r in ok for x in r.get("itl") or []]
    if metric == "tpot":
        return [t for t in map(tpot, ok) if t is not None]
    if metric == "e2el":
        return [r["e2e"] for r in ok if r.get("e2e") is not None]
    raise ValueError(metric)


def is_mismatch(rec: dict) -> bool:
    """A request is wrong if it errored, or the stream or the details disagree with max_new_tokens."""
    want = rec["max_new_tokens"]
    return (rec.get("error") is not None or rec["tokens"] != want
            or (rec.get("generated_tokens") is not None and rec["generated_tokens"] != want))


def error_type(message: str) -> str:
    return message.split(":", 1)[0].strip() or "unknown"


def parse_slos(spec: Optional[str]) -> dict[str, float]:
    """`ttft:500 tpot:50 e2el:3000` (milliseconds, vLLM's --goodput spelling) → {metric: seconds}."""
    slos: dict[str, float] = {}
    for part in (spec or "").replace(",", " ").split():
        key, _, value = part.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"bad SLO {part!r}: expected ttft|tpot|e2el:<ms>")
        slos[key] = float(value) / 1e3
    return slos


def meets(rec: dict, slos: dict[str, float]) -> bool:
    if rec.get("error") is not None:
        return False
    values = {"ttft": rec.get("ttft"), "tpot": tpot(rec), "e2el": rec.get("e2e")}
    for key, limit in slos.items():
        if values[key] is None:
            if key == "tpot":  # a one-token answer has no TPOT; it does not break that SLO
                continue
            return False
        if values[key] > limit:
            return False
    return True


def summarize(recs: list[dict], wall: float, percentiles=(50, 90, 99), slos: Optional[dict] = None) -> dict:
    out_tokens = sum(r["tokens"] for r in recs)
    ok = [r for r in recs if r.get("error") is None]
    s = {
        "requests": len(recs), "completed": len(ok), "wall_s": wall,
        "input_tokens": sum(r["prompt_tokens"] for r in recs),
        "output_tokens": out_tokens, "expected_output_tokens": sum(r["max_new_tokens"] for r in recs),
        "output_tok_s": out_tokens / wall if wall > 0 else float("nan"),
        "total_tok_s": (out_tokens + sum(r["prompt_tokens"] for r in ok)) / wall if wall > 0 else float("nan"),
        "req_s": len(ok) / wall if wall > 0 else float("nan"),
    }
    for m in METRICS:
        xs = samples(recs, m)
        s[f"{m}_mean_ms"] = sum(xs) / len(xs) * 1e3 if xs else float("nan")
        for q in percentiles:
            s[f"{m}_p{q:g}_ms"] = percentile(xs, q) * 1e3
    # the names the first cb-bench printed, kept for scripts that read its JSON
    s["e2e_p50_s"] = percentile(samples(recs, "e2el"), 50)
    s["e2e_p99_s"] = percentile(samples(recs, "e2el"), 99)
    errors: dict[str, int] = {}
    for r in recs:
        if r.get("error") is not None:
            errors[error_type(r["error"])] = errors.get(error_type(r["error"]), 0) + 1
    s["errors"] = sum(errors.values())
    s["errors_by_type"] = errors
    s["mismatches"] = sum(is_mismatch(r) for r in recs)
    if slos:
        good = sum(meets(r, slos) for r in recs)
        s["slos_ms"] = {k: v * 1e3 for k, v in slos.items()}
        s["good_requests"] = good
        s["goodput_req_s"] = good / wall if wall > 0 else float("nan")
    return s


def fmt_ms(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1f}"


def report(s: dict, percentiles=(50, 90, 99), title: str = "") -> str:
    """A vLLM-style block of text for one run."""
    w = 50
    lines = [f"{(' ' + title + ' ') if title else ''}".center(w, "=")]
    row = lambda k, v: lines.append(f"{k:<38}{v:>12}")  # noqa: E731
    row("Successful requests:", s["completed"])
    row("Benchmark duration (s):", f"{s['wall_s']:.2f}")
    row("Total input tokens:", s["input_tokens"])
    row("Total generated tokens:", f"{s['output_tokens']}/{s['expected_output_tokens']}")
    row("Request throughput (req/s):", f"{s['req_s']:.3f}")
    row("Output token throughput (tok/s):", f"{s['output_tok_s']:.1f}")
    row("Total token throughput (tok/s):", f"{s['total_tok_s']:.1f}")
    if "goodput_req_s" in s:
        row("Request goodput (req/s):", f"{s['goodput_req_s']:.3f}")
    for m in METRICS:
        lines.append(f" {LABELS[m]} (ms) ".center(w, "-"))
        row(f"Mean {LABELS[m]} (ms):", fmt_ms(s[f"{m}_mean_ms"]))
        for q in percentiles:
            row(f"P{q:g} {LABELS[m]} (ms):", fmt_ms(s[f"{m}_p{q:g}_ms"]))
    errs = ", ".join(f"{k} {v}" for k, v in s["errors_by_type"].items()) or "none"
    row("Errors:", errs)
    row("Wrong token counts:", s["mismatches"])
    lines.append("=" * w)
    return "\n".join(lines)


def side_by_side(runs: list[tuple[str, dict]], percentiles=(50, 99)) -> str:
    """One column per system: the comparison the issue asks for, on one screen."""
    keys = [("output tok/s", "output_tok_s", "{:.1f}"), ("req/s", "req_s", "{:.3f}"),
            ("duration (s)", "wall_s", "{:.2f}")]
    for m in ("ttft", "itl", "tpot", "e2el"):
        keys.append((f"{LABELS[m]} mean (ms)", f"{m}_mean_ms", "{:.1f}"))
        keys += [(f"{LABELS[m]} p{q:g} (ms)", f"{m}_p{q:g}_ms", "{:.1f}") for q in percentiles]
    keys.append(("errors", "errors", "{}"))
    names = [n for n, _ in runs]
    width = max(14, *(len(n) + 2 for n in names))
    lines = ["".ljust(20) + "".join(n.rjust(width) for n in names)]
    for label, key, f in keys:
        cells = []
        for _, s in runs:
            v = s.get(key)
            cells.append(("-" if v is None or (isinstance(v, float) and math.isnan(v)) else f.format(v)).rjust(width))
        lines.append(label.ljust(20) + "".join(cells))
    return "\n".join(lines)
