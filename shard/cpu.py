"""What this machine's CPU can do, from the flags Linux reports (empty elsewhere: callers then assume the least),
and where the shard keeps what it built or measured for this machine."""
import os
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=None)
def flags() -> frozenset[str]:
    # Not psutil (no flags) nor torch's few capability queries: the full set keys the kernels built for this CPU.
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split()[2:])
    except OSError:
        return frozenset()


def cache_dir(kind: str) -> Path:
    """$CB_CACHE (default ~/.cache/cb) / kind: models (the launcher's converted ones), kernels, linears, inductor
    (torch.compile's, compiled.py)."""
    return Path(os.environ.get("CB_CACHE") or Path.home() / ".cache" / "cb").expanduser() / kind
