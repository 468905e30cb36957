"""Brings the shards up, then the router, and watches them until the launcher is told to stop.

A shard exiting (it crashed, or the router ended a hung or late shard set) replaces the whole shard set: the
survivors are killed (their collectives cannot complete), a new set is started, and the router, which waits for
it, resumes every request. After --max-restarts replacements in a row, or when the router itself dies,
everything stops (exit 1). SIGTERM or SIGINT drains instead: the router finishes in-flight requests first,
then the shards stop (exit 0).
"""
import os
import signal
import time
from typing import Callable, Optional

from launcher.children import Child, describe_exit, log, stop_all
from launcher.nodes import NOT_REPLACED, Remote, RemoteLost
from launcher.readiness import router_healthy, shard_healthy

FAILURE_STOP_TIMEOUT = 5.0  # s between SIGTERM and SIGKILL when tearing down after a failure
SHARD_STOP_TIMEOUT = 10.0   # s the shards get to exit once the router has drained
ROUTER_STOP_MARGIN = 10.0   # s on top of --graceful-timeout before the router is killed
RESTART_BACKOFF = (1.0, 2.0, 4.0, 8.0, 16.0)  # s before each replacement in a row (the last repeats)
STABLE_AFTER = 3600.0       # s of service after which replacements in a row count from zero again


class ChildExited(Exception):
    """A child stopped while nobody asked it to."""

    def __init__(self, child: Child):
        super().__init__(f"{child.name} {describe_exit(child.exit_code())}")
        self.child = child


class StopRequested(Exception):
    """SIGTERM or SIGINT reached the launcher."""


class Supervisor:
    """Owns the children. Every wait of the launcher goes through wait_until, so a child dying or a
    stop signal is noticed whatever the launcher is waiting for (a shard loading, or nothing)."""

    def __init__(self, router_env: dict[str, str], started: Optional[float] = None):
        """`started`: when the launcher started (time.monotonic()), which the phases it logs count from."""
        self.children: list[Child] = []
        self.started = time.monotonic() if started is None else started
        self.stop_signal: Optional[str] = None
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self.router_env = {**self.env, **router_env}
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.stop_signal = self.stop_signal or signal.Signals(signum).name

    def spawn(self, name: str, argv: list[str], env: Optional[dict[str, str]] = None) -> Child:
        child = Child(name, argv, env or self.env)
        self.children.append(child)
        return child

    def wait_until(self, ready: Callable[[], bool], waiting_for: Optional[Callable[[], str]] = None,
                   interval: float = 0.2, report_every: float = 10.0, timeout: Optional[float] = None) -> None:
        """Polls `ready` (for at most `timeout` s); reports progress every report_every seconds when told what it
        waits for."""
        start = time.monotonic()
        next_report = start + report_every
        while timeout is None or time.monotonic() - start < timeout:
            if self.stop_signal:
                raise StopRequested
            for child in self.children:
                if child.exit_code() is not None:
                    raise ChildExited(child)
            if ready():
                return
            if waiting_for is not None and time.monotonic() >= next_report:
                log("launcher", f"waiting for {waiting_for()}… ({time.monotonic() - start:.0f} s)")
                next_report += report_every
            time.sleep(interval)

    def shards_up(self, sockets: list[str]) -> tuple[Callable[[], bool], dict[int, str]]:
        """A probe that says each shard is up once (with the time since the launcher started) and whether all are,
        and the ranks it still waits for."""
        pending = dict(enumerate(sockets))

        def all_healthy() -> bool:
            for rank, path in list(pending.items()):
                if shard_healthy(path):
                    del pending[rank]
                    log("launcher", f"shard {rank} is up ({self.elapsed()})")
            return not pending
        return all_healthy, pending

    def elapsed(self) -> str:
        return f"{time.monotonic() - self.started:.1f} s since the launcher started"

    def run(self, shard_argvs: list[list[str]], sockets: list[str], router_argv: Callable[[list[str]], list[str]],
            url: str, graceful_timeout: float, max_restarts: int, before_shards: Callable[[], None] = lambda: None,
            remote: Optional[Remote] = None) -> int:
        """Serves until the router dies or the restarts run out (returns 1), or a stop signal has drained
        everything (returns 0). `before_shards` runs before each shard set starts. `remote`: the ranks on other
        nodes (nodes.py), whose addresses the router is started with once they have loaded; such a set is never
        replaced."""
        self.before_shards = before_shards
        shards, router = [], None
        try:
            shards = self.spawn_shards(shard_argvs)
            if remote is not None:
                self.wait_until(remote.published, remote.pending)
                sockets = sockets + [remote.addresses[rank] for rank in remote.ranks]
            # the router starts beside the shards (its imports and tokenizer take seconds too) and waits for them
            router = self.spawn("router", router_argv(sockets), self.router_env)
            up, pending = self.shards_up(sockets)
            self.wait_until(lambda: up() and router_healthy(url),
                            lambda: (", ".join(f"shard {rank}" for rank in pending) + " to load") if pending
                            else "the router to warm up the shards")
            log("launcher", f"ready: {url} ({self.elapsed()})")
            if remote is not None:
                self.wait_until(remote.check)
            self.serve(shards, shard_argvs, sockets, max_restarts)
        except (ChildExited, RemoteLost) as error:
            if remote is not None:  # the cause first: a rank on another node gone ends the local ones too
                silent = remote.silent() if isinstance(error, ChildExited) else []
                cause = f"{', '.join(silent)} stopped answering ({error})" if silent else str(error)
                log("launcher", f"{cause}: {NOT_REPLACED}: stopping everything")
            else:
                log("launcher", f"{error}: stopping everything")
            return 1
        except StopRequested:
            log("launcher", f"{self.stop_signal}: shutting down, letting in-flight requests finish")
            if router is not None:
                stop_all([router], graceful_timeout + ROUTER_STOP_MARGIN)
            stop_all([c for c in self.children if c is not router], SHARD_STOP_TIMEOUT)
            log("launcher", "stopped")
            return 0
        finally:  # also reached on a bug in the launcher itself: no child may outlive it
            stop_all(self.children, FAILURE_STOP_TIMEOUT)

    def run_ranks(self, shard_argvs: list[list[str]], first_rank: int) -> int:
        """A node other than 0: its ranks only, until one exits (1: the set is over, nodes.py) or a stop signal
        (0)."""
        try:
            for offset, argv in enumerate(shard_argvs):
                self.spawn(f"shard {first_rank + offset}", argv)
            log("launcher", "started; node 0's router drives these shards once every node's have loaded")
            self.wait_until(lambda: False)
        except ChildExited as error:
            log("launcher", f"{error}: {NOT_REPLACED}: stopping everything")
            return 1
        except StopRequested:
            log("launcher", f"{self.stop_signal}: stopping")
            return 0
        finally:
            stop_all(self.children, FAILURE_STOP_TIMEOUT)

    def spawn_shards(self, shard_argvs: list[list[str]]) -> list[Child]:
        self.before_shards()
        return [self.spawn(f"shard {rank}", argv) for rank, argv in enumerate(shard_argvs)]

    def start_shards(self, shard_argvs: list[list[str]], sockets: list[str]) -> list[Child]:
        """A new set, once every shard of it is up."""
        shards = self.spawn_shards(shard_argvs)
        up, pending = self.shards_up(sockets)
        self.wait_until(up, lambda: ", ".join(f"shard {rank}" for rank in pending) + " to load")
        return shards

    def serve(self, shards: list[Child], shard_argvs: list[list[str]], sockets: list[str], max_restarts: int):
        """Waits forever, replacing the shard set whenever one of its shards exits."""
        in_a_row, since = 0, time.monotonic()
        while True:
            try:
                self.wait_until(lambda: False)
            except ChildExited as error:
                if error.child not in shards:
                    raise
                if time.monotonic() - since > STABLE_AFTER:
                    in_a_row = 0
                if in_a_row >= max_restarts:
                    log("launcher", f"{error}; the shard set was replaced {in_a_row} time(s) in a row "
                                    "(--max-restarts)")
                    raise
                in_a_row += 1
                shards = self.replace_shards(error, shards, shard_argvs, sockets, in_a_row, max_restarts)
                since = time.monotonic()

    def replace_shards(self, error: ChildExited, shards: list[Child], shard_argvs: list[list[str]],
                       sockets: list[str], attempt: int, max_restarts: int) -> list[Child]:
        log("launcher", f"{error}: replacing the shard set (restart {attempt} of at most {max_restarts} in a row)")
        for child in shards:
            child.proc.kill()
        stop_all(shards, FAILURE_STOP_TIMEOUT)
        self.children = [c for c in self.children if c not in shards]
        pause = RESTART_BACKOFF[min(attempt, len(RESTART_BACKOFF)) - 1]
        self.wait_until(lambda: False, timeout=pause)
        shards = self.start_shards(shard_argvs, sockets)
        log("launcher", "the new shard set is up; the router resumes its requests")
        return shards
