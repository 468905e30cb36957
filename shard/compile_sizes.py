"""`--compile-sizes`: which step sizes compiled.py compiles. Pure Python, so the launcher refuses a bad list
before it starts a shard, by the shards' own reading of it."""

AUTO = {"cpu": (1, 2, 4, 8, 16, 24, 32), "cuda": (1, 2, 4, 8, 16, 32)}  # what `auto` means on each device


def parse(text: str, device_type: str) -> tuple[int, ...]:
    """`auto`, `0` (none) or a comma-separated list of step sizes in tokens, sorted."""
    if text.strip() == "auto":
        return AUTO.get(device_type, ())
    try:
        sizes = {int(part) for part in text.split(",")}
    except ValueError:
        raise ValueError(f"--compile-sizes {text!r}: a comma-separated list of step sizes in tokens, auto, "
                         "or 0 for none") from None
    if any(s < 0 for s in sizes):
        raise ValueError(f"--compile-sizes {text!r}: step sizes are token counts, 1 or more (0 alone: none)")
    return tuple(sorted(s for s in sizes if s > 0))
