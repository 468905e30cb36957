"""A JSON-lines record of every scheduling decision, so the simulator can replay the same arrivals through
the same scheduler code and be checked against what the live router did. Each line also carries how long the
step before it took, as the pacer saw it, and the first line the steps Warmup timed, which the pacer started from,
so a replay paces its prompt chunks exactly as the live router did."""
import json
import time
from typing import Optional, TextIO

from router.core.request import Request
from router.core.step import Step


class Trace:
    def __init__(self, out: Optional[TextIO]):
        self.out = out
        self.arrivals: list[dict] = []
        self.finished: list[list[int]] = []
        self.took: Optional[float] = None
        self.steps = 0
        self.calibration: list = []  # Warmup's timed steps (decodes, chunk start, chunk tokens, seconds) the pacer
                                     # starts from: written on the first line

    def arrive(self, req: Request) -> None:
        if self.out:
            self.arrivals.append({"id": req.id, "prompt_tokens": len(req.prompt_ids),
                                  "max_new_tokens": req.max_new_tokens, "priority": req.priority})

    def finish(self, req: Request, discarded: int = 0) -> None:
        """`discarded`: tokens it was given steps for beyond those it kept (a stop sequence found while the next
        step ran), so a replay schedules it for as long as the live router did."""
        if self.out:
            self.finished.append([req.id, len(req.generated) + discarded])

    def ran(self, seconds: float) -> None:
        """The last step's measured time (what the pacer learned from), written with the next line."""
        self.took = seconds

    def step(self, step: Step) -> None:
        """Written after retirements and arrivals are known and the scheduler has decided."""
        if not self.out:
            return
        line = {
            "step": self.steps, "time": time.monotonic(), "took": self.took, "arrivals": self.arrivals,
            "finished": self.finished,
            "entries": [[e.request.id, e.start, e.num_tokens, e.sample] for e in step.entries],
            "preempted": [r.id for r in step.preempted],
            "offloaded": [r.id for r in step.offloaded], "restored": [r.id for r in step.restored],
        }
        if self.steps == 0 and self.calibration:
            line["calibration"] = self.calibration
        self.out.write(json.dumps(line) + "\n")
        self.out.flush()
        self.arrivals, self.finished, self.took = [], [], None
        self.steps += 1
