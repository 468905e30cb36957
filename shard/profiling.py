"""Named scopes that bench/profile.py splits a step's time by. Free (one shared null context) unless a profile
is being taken: record_function costs microseconds, and a step opens hundreds of them."""
import contextlib

from torch.profiler import record_function

enabled = False
_NULL = contextlib.nullcontext()


def scope(name: str):
    return record_function(f"cb::{name}") if enabled else _NULL
