"""Replacing a failed shard set. The router ends every process of the old set (a hung shard would never answer
again, and the survivors of a tensor-parallel set are stuck in its collectives); the launcher, seeing its shards
exit, starts a new set (up to --max-restarts); the router waits for every rank to answer from a new process,
warms the set up to the very pools it had, and the engine resumes each request from its history."""
import asyncio
import logging
import time

import psutil

from proto import generate_pb2 as pb
from router.shards import ShardError, Shards

log = logging.getLogger("router")
RESTART_TIMEOUT = 600.0  # s for a new set to load and answer (the launcher's own limit usually ends it sooner)


class RecoveryError(Exception):
    pass


def end_processes(pids: list[int], sockets: list[str]) -> None:
    """SIGKILLs the old set's processes: only those whose command line names one of our sockets, so a reused
    pid is never hit."""
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            cmdline = "\0".join(proc.cmdline())
            if any(s in cmdline for s in sockets):
                proc.kill()  # SIGKILL, and only while pid is still the process read above
        except psutil.Error:
            pass  # already gone


class Recovery:
    def __init__(self, shards: Shards, sizing: dict, pools: pb.WarmupResponse, timeout: float = RESTART_TIMEOUT):
        self.shards = shards
        self.sizing = {**sizing, "num_blocks": pools.num_blocks}  # the same pools again, not a fresh estimate
        self.pools = pools
        self.timeout = timeout

    async def restart(self) -> None:
        old = list(self.shards.pids)
        end_processes(old, self.shards.sockets)
        await self._wait_for_new_set(set(old))
        pools = await self.shards.warmup(**self.sizing)
        fields = ("num_blocks", "num_window_blocks", "num_swap_blocks")
        if any(getattr(pools, f) != getattr(self.pools, f) for f in fields):
            raise RecoveryError(f"the new shards' pools ({pools}) differ from the old ones ({self.pools})")

    async def _wait_for_new_set(self, old: set[int]) -> None:
        give_up = time.monotonic() + self.timeout
        while time.monotonic() < give_up:
            await asyncio.sleep(0.5)
            await self.shards.reconnect()
            try:
                await self.shards.info()
            except ShardError:
                continue
            if not old & set(self.shards.pids) and await self.shards.alive():
                log.info("a new shard set answers (pids %s)", self.shards.pids)
                return
        raise RecoveryError(f"no new shard set answered within {self.timeout:.0f} s")
