"""When the step sizes compile (compiled.py), so that a shard serves seconds after it starts.

Compiling takes 12-45 s on a 2-core CPU (dynamo traces the model, inductor builds its kernels; less when inductor's
cache under $CB_CACHE holds them), so on CPU it runs on a thread of its own after Warmup, on a scratch pool, while
every served step runs eagerly; once every size is compiled the graphs take over between two steps, on the main
thread. Served steps are correct throughout: while dynamo compiles, `torch.compiler.is_compiling()` reads True in
every thread, so eager steps take the same ops through their torch.library wrappers (same kernels, same results).
They are slower meanwhile: the compile holds the GIL in turns (a decode step of one request measured 11 ms alone,
47 ms beside a thread that never sleeps, 29 ms with the 1 ms switch interval set here), and it runs at the lowest
CPU priority, it and the compiler processes it starts (W64 sent at the first /health 200 on a 2-core EPYC: 298
tok/s with the compile at normal priority, 421-447 at nice 19, 491 once it is over).

Compiling stays inside Warmup, before the shard serves, where it cannot run beside served steps: CUDA graphs (a
capture forbids other work on the device) and tensor-parallel sets (the compile's steps would interleave their
collectives with the served steps').
"""
import logging
import os
import sys
import threading
import time
from typing import Optional

from shard.main_thread import MainThread
from shard.runner import Runner

log = logging.getLogger("cb.shard")
SWITCH_INTERVAL = 0.001  # s a thread holds the GIL before it must let another run, while compiling (Python's: 5 ms)
NICE = 19  # the compile thread's CPU priority, and its compiler workers': served steps first


class Compiling:
    """The step sizes' compile: `state` off (nothing to compile), pending (until Warmup), compiling, ready or
    failed (every step stays eager)."""

    def __init__(self, runner: Runner, main: Optional[MainThread], world: int):
        self.runner = runner
        self.main = main  # where go_live runs (between two steps); None: in the compiling thread
        compiled = runner.compiled
        self.background = compiled is not None and not compiled.cuda and world == 1
        self.state = "off" if compiled is None else "pending"
        self.seconds = 0.0  # from the start of the compile until the graphs serve

    @property
    def sizes(self) -> tuple[int, ...]:
        """The step sizes served steps run compiled."""
        return self.runner.compiled.sizes if self.state == "ready" else ()

    def start(self) -> None:
        """At the first Warmup (its pools are sized): compiles here, or starts the thread that does."""
        if self.state != "pending":
            return
        self.state = "compiling"
        if self.background:
            threading.Thread(target=self._run, name="compile step sizes", daemon=True).start()
        else:
            self._run()

    def _run(self) -> None:
        start = time.perf_counter()
        interval = sys.getswitchinterval()
        if self.background:
            sys.setswitchinterval(SWITCH_INTERVAL)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)  # this thread (and what it starts) only
        try:
            compiled = self.runner.compile()
            if compiled:
                sys.setswitchinterval(interval)
                self._on_main(self.runner.go_live)
        except Exception:  # go_live's race: the graphs do not serve, nothing else changes
            log.exception("the compiled step sizes could not go live; every step runs eagerly")
            compiled = False
        finally:
            sys.setswitchinterval(interval)
        self.seconds = time.perf_counter() - start
        self.state = "ready" if compiled else "failed"
        if compiled and self.background:
            log.info("compiled steps serve from now on (%.1f s after Warmup)", self.seconds)

    def _on_main(self, fn) -> None:
        if self.main is not None and self.background:
            self.main.call(fn)
        else:
            fn()
