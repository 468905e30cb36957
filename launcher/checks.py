"""What the launcher refuses before it spawns anything: mistakes that would otherwise surface only after every
shard has loaded, buried in a child's traceback. Each rule is the one its process applies (imported from it, not
restated): the shards' split rule and reading of --compile-sizes, the router's reading of the API key, its pacer's
ratio."""
import json
from pathlib import Path

from router.core.pacing import pacer
from router.server import api_key
from router.settings import Settings
from shard import compile_sizes
from shard.split_rule import SplitWidths, check_shard_count


class LaunchError(Exception):
    """The settings cannot work with this model; the message says what to change."""


def check_launch(settings: Settings, model_dir: Path) -> None:
    try:
        api_key(settings)
        pacer(settings.prefill_step_ratio)
        compile_sizes.parse(settings.compile_sizes, settings.device)
        if settings.nnodes > 1 and settings.num_shard % settings.nnodes:
            raise ValueError(f"--num-shard {settings.num_shard} does not split evenly over --nnodes {settings.nnodes}: "
                             "every node runs the same number of shards")
        if settings.node_rank >= settings.nnodes:
            raise ValueError(f"--node-rank {settings.node_rank}: the nodes are numbered 0 to --nnodes - 1 "
                             f"({settings.nnodes - 1})")
        if settings.num_shard > 1:
            check_shard_count(split_widths(model_dir, settings), settings.num_shard, settings.model_id)
    except ValueError as error:
        raise LaunchError(str(error)) from None


def split_widths(model_dir: Path, settings: Settings) -> SplitWidths:
    config = json.loads((model_dir / "config.json").read_text())
    try:
        return SplitWidths.of(config)
    except KeyError as missing:
        raise LaunchError(f"--num-shard {settings.num_shard} cannot split {settings.model_id}: its config.json has "
                          f"no {missing} (tensor parallelism splits Llama-style decoders)") from None
