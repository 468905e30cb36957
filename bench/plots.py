"""PNG plots for cb-bench and cb-sim (matplotlib, headless). Each function takes plain numbers and a path."""
from __future__ import annotations

import math
from pathlib import Path

from bench.stats import LABELS, samples


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def latency_cdfs(runs: list[tuple[str, list[dict]]], path: Path, title: str = "") -> Path:
    """One panel per metric (TTFT, ITL, TPOT, E2E), one line per system: the empirical CDF in ms."""
    plt = _plt()
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, metric in zip(axes, ("ttft", "itl", "tpot", "e2el")):
        for name, recs in runs:
            xs = sorted(x * 1e3 for x in samples(recs, metric))
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
        ax.set_xlabel(f"{LABELS[metric]} (ms)")
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
        if metric in ("ttft", "e2el"):
            from matplotlib.ticker import NullFormatter
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
    axes[0].set_ylabel("fraction of samples")
    axes[-1].legend(loc="lower right", fontsize=8)
    return _save(plt, fig, path, title)


def rate_sweep(series: dict[str, list[tuple[float, dict]]], path: Path, title: str = "",
               latency_key: str = "e2el_p99_ms", latency_label: str = "p99 E2E latency (ms)",
               throughput_key: str = "output_tok_s", throughput_label: str = "output tok/s",
               x_label: str = "arrival rate (req/s)") -> Path:
    """Throughput and a latency against offered request rate (or what `x_label` says), one line per system
    ({name: [(x, summary)]})."""
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    for name, points in series.items():
        pts = [(r, s) for r, s in points if not math.isinf(r)]
        if not pts:
            continue
        xs = [r for r, _ in pts]
        a.plot(xs, [s[throughput_key] for _, s in pts], marker="o", label=name)
        b.plot(xs, [s[latency_key] for _, s in pts], marker="o", label=name)
    a.set_xlabel(x_label)
    a.set_ylabel(throughput_label)
    b.set_xlabel(x_label)
    b.set_ylabel(latency_label)
    b.set_yscale("log")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(plt, fig, path, title)


def budget_heatmap(totals: list[int], prefills: list[int], values: dict[tuple[int, int], float], slo_ms: float,
                   path: Path, title: str = "") -> Path:
    """p99 TTFT (ms) for each (--max-batch-total-tokens, --max-batch-prefill-tokens); cells over the SLO hatched."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(1.2 * len(prefills) + 3, 0.5 * len(totals) + 2))
    grid = [[values[(t, p)] for p in prefills] for t in totals]
    im = ax.imshow(grid, aspect="auto", cmap="viridis_r", origin="lower")
    for i, t in enumerate(totals):
        for j, p in enumerate(prefills):
            v = values[(t, p)]
            ax.text(j, i, f"{v:.0f}{'' if v <= slo_ms else ' ✗'}", ha="center", va="center", fontsize=7,
                    color="white" if v > slo_ms else "black")
    ax.set_xticks(range(len(prefills)), [str(p) for p in prefills])
    ax.set_yticks(range(len(totals)), [str(t) for t in totals])
    ax.set_xlabel("--max-batch-prefill-tokens")
    ax.set_ylabel("--max-batch-total-tokens")
    fig.colorbar(im, ax=ax, label="p99 TTFT (ms)")
    ax.set_title(title or f"p99 TTFT, SLO {slo_ms:g} ms")
    return _save(plt, fig, path)


def _save(plt, fig, path: Path, title: str = "") -> Path:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return Path(path)
