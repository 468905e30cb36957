"""Does someone else's long prompt stall the streams already running? (`python -m bench.interference`)

N streams start at once (short prompts, a forced number of tokens each); once they are decoding, one long prompt
arrives. Reported: the streams' inter-token latency (p50, p99, their ratio, the worst gap), and the long prompt's
time to first token. Any server behind `--backend tgi|openai` (cb, llama.cpp's llama-server, vLLM), through the
same client as cb-bench, so one run compares them. Numbers for the README, never for tests.

A cb server needs room for the long prompt, e.g.
`cb-launcher --max-input-tokens 2048 --max-total-tokens 4096 --max-batch-total-tokens 32768`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from bench import client
from bench.stats import percentile
from bench.workloads import random_workload

app = typer.Typer(add_completion=False, rich_markup_mode=None, help=__doc__)


def measure(url: str, backend: str, streams: int, stream_tokens: int, long_prompt: int, arrive_after: float,
            seed: int) -> dict:
    reqs = random_workload(streams, 32, stream_tokens, seed=seed)
    reqs.append(random_workload(1, long_prompt, 16, seed=seed + 1)[0])
    reqs[-1].id = streams
    recs, wall = client.run(url, reqs, [0.0] * streams + [arrive_after], progress=False,
                            backend=client.backend_for(url, backend))
    errors = [r["error"] for r in recs if r["error"]]
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed, e.g. {errors[0]}")
    itl = [x for r in recs[:streams] for x in r["itl"]]
    p50, p99 = percentile(itl, 50), percentile(itl, 99)
    long = recs[-1]
    return {"streams": streams, "stream_tokens": stream_tokens, "long_prompt": long_prompt,
            "arrive_after_s": arrive_after, "itl_p50_ms": 1e3 * p50, "itl_p99_ms": 1e3 * p99,
            "p99_over_p50": p99 / p50, "worst_gap_ms": 1e3 * max(itl), "long_ttft_s": long["ttft"],
            "long_started_s": long["start"], "wall_s": wall}


URL, BACKEND, LABEL = client.cli_options()


@app.command()
def main(
    url: str = URL,
    backend: str = BACKEND,
    label: str = LABEL,
    streams: int = typer.Option(8, help="Streams decoding when the long prompt arrives."),
    stream_tokens: int = typer.Option(200, help="Tokens each stream generates (forced, ignore_eos)."),
    long_prompt: int = typer.Option(2000, help="Tokens of the prompt that arrives while they decode."),
    arrive_after: float = typer.Option(3.0, help="Seconds after the streams start that the long prompt is sent."),
    seed: int = typer.Option(0, help="Seed of the random token ids."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the result here."),
):
    url = url.rstrip("/")
    r = measure(url, backend, streams, stream_tokens, long_prompt, arrive_after, seed)
    typer.echo(f"{label}: {streams} streams x {stream_tokens} tokens, a {long_prompt}-token prompt after "
               f"{arrive_after:g} s | ITL p50 {r['itl_p50_ms']:.0f} ms, p99 {r['itl_p99_ms']:.0f} ms "
               f"({r['p99_over_p50']:.1f}x), worst gap {r['worst_gap_ms']:.0f} ms | long prompt TTFT "
               f"{r['long_ttft_s']:.2f} s")
    if json_out:
        json_out.write_text(json.dumps({"label": label, "url": url, "backend": backend, **r}, indent=2))


if __name__ == "__main__":
    app()
