"""What this machine's CPU can do, from the flags Linux reports (empty elsewhere: callers then assume the least)."""
from functools import lru_cache


@lru_cache(maxsize=None)
def flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split()[2:])
    except OSError:
        return frozenset()
