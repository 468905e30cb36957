"""How long a shard call may take before the shard counts as failed: a multiple of the slowest step seen,
never under a floor (a cold machine's first steps are slow), never over the operator's bound
(--shard-timeout). Pure Python: the engine and its tests share it."""
import time

FLOOR = 10.0   # s: no call is failed sooner, whatever the measured steps say
FACTOR = 10.0  # a call may take this many times the slowest step seen so far


class Deadline:
    def __init__(self, bound: float):
        self.bound = bound
        self.slowest = 0.0
        self.last_answer = time.monotonic()  # when every shard last answered a call

    @property
    def seconds(self) -> float:
        return min(self.bound, max(FLOOR, FACTOR * self.slowest))

    def answered(self, took: float) -> None:
        self.slowest = max(self.slowest, took)
        self.last_answer = time.monotonic()

    @property
    def silent_for(self) -> float:
        return time.monotonic() - self.last_answer
