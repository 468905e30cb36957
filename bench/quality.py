"""What a cheaper numeric mode costs in quality (`python -m bench.quality`): each mode (a dtype, optionally with
--quantize) runs on a shard's Runner in-process, and is compared with a reference mode on a fixed text
(bench/data/quality.txt): the perplexity of the whole text (its prompt logprobs), and greedy continuations of
each of its lines (32 new tokens): how many tokens agree with the reference before the first difference.

Numbers for the README, never for tests.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import typer

from router.settings import Settings

app = typer.Typer(add_completion=False, rich_markup_mode=None, help=__doc__)
DEFAULTS = Settings()
TEXT = Path(__file__).resolve().parent / "data" / "quality.txt"


class Mode:
    def __init__(self, model_dir: str, spec: str, block_size: int):
        import torch

        from shard.model import load
        from shard.runner import Runner

        dtype, _, quantize = spec.partition("+")
        self.name = spec
        self.loaded = load(model_dir, dtype, torch.device("cpu"), 0, 1, quantize or None)
        self.runner = Runner(self.loaded, torch.device("cpu"), block_size, 0, 1)
        self.block_size = block_size
        self.runner.allocate(256)

    def logprobs(self, ids: list[int], chunk: int = 256) -> list[float]:
        """Every token's logprob given those before it (the first one has none), in prompt chunks."""
        from shard.sampling import Params
        from shard.step import Entry

        self.runner.clear()
        blocks = list(range(-(-len(ids) // self.block_size)))
        out: list[float] = []
        for start in range(0, len(ids), chunk):
            first = start == 0
            e = Entry(1, ids[start:start + chunk], blocks if first else [], sample=start + chunk >= len(ids),
                      cached_tokens=start, params=Params() if first else None, prompt_tokens=len(ids),
                      prefill_logprobs=True)
            out += self.runner.step([e]).prefill[0][1]
        return out[1:]

    def greedy(self, ids: list[int], n: int) -> list[int]:
        from shard.sampling import Params
        from shard.step import Entry

        self.runner.clear()
        blocks = list(range(-(-(len(ids) + n) // self.block_size)))
        tokens = [self.runner.step([Entry(1, ids, blocks, sample=True, params=Params())]).generations[0].token_id]
        for k in range(n - 1):
            e = Entry(1, tokens[-1:], [], sample=True, cached_tokens=len(ids) + k)
            tokens.append(self.runner.step([e]).generations[0].token_id)
        return tokens


def agreement(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@app.command()
def main(modes: str = typer.Option("float32,bfloat16,bfloat16+int8", help="dtype[+quantize], comma-separated; "
                                   "the first is the reference"),
         model_id: str = typer.Option(DEFAULTS.model_id), new_tokens: int = typer.Option(32),
         json_out: Optional[Path] = typer.Option(None, "--json")):
    from transformers import AutoTokenizer

    from launcher.model_files import resolve_model

    model_dir = str(resolve_model(model_id))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = TEXT.read_text()
    ids = tokenizer(text)["input_ids"]
    lines = [tokenizer(line)["input_ids"] for line in text.splitlines() if line.strip()]
    prompts = [line[:len(line) // 2] for line in lines]
    results, reference = [], None
    for spec in modes.split(","):
        mode = Mode(model_dir, spec, DEFAULTS.block_size)
        lps = mode.logprobs(ids)
        continuations = [mode.greedy(p, new_tokens) for p in prompts]
        row = {"mode": spec, "tokens": len(ids), "perplexity": math.exp(-sum(lps) / len(lps))}
        if reference is None:
            reference = continuations
        agree = [agreement(c, r) for c, r in zip(continuations, reference)]
        row.update(identical=sum(a == new_tokens for a in agree), prompts=len(prompts),
                   agreeing_tokens=sum(agree) / (len(prompts) * new_tokens))
        results.append(row)
        typer.echo(f"{spec:>16}: perplexity {row['perplexity']:.3f} over {len(ids)} tokens; greedy continuations "
                   f"identical to {modes.split(',')[0]}: {row['identical']}/{len(prompts)}, tokens before the first "
                   f"difference {row['agreeing_tokens']:.1%}")
    if json_out:
        json_out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    app()
