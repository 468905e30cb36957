"""How long a shard call may take before the shard counts as failed: a multiple of the slowest step served, never
under a floor (a cold machine's first steps are slow), never over the operator's bound (--shard-timeout). Only
served steps set it: Warmup (which may compile) and probes do not. A shard that stops answering at all is found
sooner, by the hang probe (shards.py). Pure Python: the engine and its tests share it."""
import time

FLOOR = 10.0   # s: no call is failed sooner, whatever the measured steps say
FACTOR = 10.0  # a call may take this many times the slowest step served so far


class Deadline:
    def __init__(self, bound: float):
        self.bound = bound
        self.slowest = 0.0
        self.last_answer = time.monotonic()  # when every shard last answered a call

    @property
    def seconds(self) -> float:
        return min(self.bound, max(FLOOR, FACTOR * self.slowest))

    def answered(self, took: float, step: bool = True) -> None:
        """Every shard answered a call that took `took` s; a served step's time moves the deadline."""
        if step:
            self.slowest = max(self.slowest, took)
        self.last_answer = time.monotonic()

    @property
    def silent_for(self) -> float:
        return time.monotonic() - self.last_answer
