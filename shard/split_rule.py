"""Which shard counts can split a model: the one rule the shards apply when they split it (tensor_parallel.py) and
the launcher checks before spawning any of them (launcher/checks.py). Pure Python, no torch: the launcher imports
it without paying for torch, and a wrong --num-shard fails in a second instead of after every shard has loaded.
"""
from dataclasses import dataclass


class ShardCountError(ValueError):
    """--num-shard cannot split this model; the message names the counts that can."""


@dataclass(frozen=True)
class SplitWidths:
    """What tensor parallelism divides: query heads and the MLP's width split evenly over the ranks; KV heads
    split evenly, or are replicated when the ranks are a multiple of them."""
    heads: int
    kv_heads: int
    mlp_width: int

    @classmethod
    def of(cls, config: dict) -> "SplitWidths":
        """From a config.json (a multimodal one keeps its decoder's under text_config); KV heads default to the
        query heads, as in transformers."""
        config = config.get("text_config", config)
        heads = config["num_attention_heads"]
        return cls(heads, config.get("num_key_value_heads") or heads, config["intermediate_size"])

    def splits_over(self, shards: int) -> bool:
        kv_fits = self.kv_heads % shards == 0 or shards % self.kv_heads == 0
        return self.heads % shards == 0 and self.mlp_width % shards == 0 and kv_fits

    def shard_counts(self) -> list[int]:
        """Every count that splits the model (none exceeds the query heads)."""
        return [n for n in range(1, self.heads + 1) if self.splits_over(n)]

    def __str__(self) -> str:
        return f"{_count(self.heads, 'attention head')}, {_count(self.kv_heads, 'KV head')}, MLP width {self.mlp_width}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("s" if n != 1 else "")


def check_shard_count(widths: SplitWidths, shards: int, model: str) -> None:
    if not widths.splits_over(shards):
        counts = [str(n) for n in widths.shard_counts()]
        choice = counts[0] if len(counts) == 1 else f"{', '.join(counts[:-1])} or {counts[-1]}"
        raise ShardCountError(f"--num-shard {shards} cannot split {model} ({widths}): use {choice}")
