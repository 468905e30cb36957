"""The batching loop: one step at a time, in the same asyncio loop as the HTTP server.

Each step: retire cancelled requests, let the scheduler decide what runs, make the shards forget soft-reset and
retired requests and move offloaded or restored blocks, run the step on every shard, then hand its outcome to
the scheduler (`update`: the one place where tokens join requests and requests finish) and each token to its job.
"""
import asyncio
import logging
from typing import Optional

from router import metrics
from router.core.request import State
from router.core.scheduler import Scheduler
from router.core.step import Outcome, Step
from router.job import Job
from router.shards import ShardError, Shards
from router.trace import Trace

log = logging.getLogger("router")


class Engine:
    def __init__(self, shards: Shards, scheduler: Scheduler, trace: Optional[Trace] = None):
        self.shards = shards
        self.scheduler = scheduler
        self.trace = trace or Trace(None)
        self.jobs: dict[int, Job] = {}
        self.wake = asyncio.Event()
        self.to_filter: list[int] = []
        self._seen_lookups = self._seen_hits = 0
        self.last_step_failed = False

    def submit(self, job: Job) -> None:
        self.jobs[job.id] = job
        self.scheduler.add(job.request)
        self.trace.arrive(job.request)
        self.wake.set()

    def cancel(self, job: Job) -> None:
        """Marks a job whose client went away; it leaves the batch at the start of the next step."""
        if job.finish_reason is None:
            job.cancelled = True
            self.wake.set()

    @property
    def busy(self) -> bool:
        return self.scheduler.busy

    async def run(self) -> None:
        """Runs steps forever; a bug in one step fails the requests it touched, never the loop."""
        while True:
            try:
                await self._loop()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.exception("batching loop error")
                await self._fail_all(f"internal error: {e!r}")

    async def _loop(self) -> None:
        while True:
            for job in [j for j in self.jobs.values() if j.cancelled]:
                self.scheduler.finish(job.request)
                self._retire(job)
            if not await self._filter():
                continue
            self.observe()
            if not self.busy:
                await self._sleep()
                continue
            step = self.scheduler.schedule()
            self.trace.step(step)
            try:
                await self._move(step)
                if not step.entries:
                    await self._sleep()
                    continue
                resp = await self.shards.step(step, self.jobs)
            except ShardError as e:
                await self._fail_all(str(e))
                continue
            self.last_step_failed = False
            metrics.observe_step(step, resp)
            self._apply(step, resp)

    async def _sleep(self) -> None:
        self.wake.clear()
        await self.wake.wait()

    def _apply(self, step: Step, resp) -> None:
        """The step's outcome: prompt logprobs, then the tokens, through the scheduler, to the jobs."""
        for p in resp.prefill:
            if p.id in self.jobs:
                self.jobs[p.id].on_prefill(p.logprobs)
        outcome, pieces = Outcome(), {}
        for g in resp.generations:
            job = self.jobs.get(g.id)
            if job is not None and job.finish_reason is None:
                outcome.tokens[g.id] = g.token_id
                pieces[g.id] = job.detokenizer.add(g.token_id)
                if job.detokenizer.stopped(pieces[g.id]):
                    outcome.stopped.add(g.id)
        finished = self.scheduler.update(step, outcome)
        for g in resp.generations:
            if g.id in pieces:
                self.jobs[g.id].on_token(g, pieces[g.id])
        for req in finished:
            self._retire(self.jobs[req.id])

    def _retire(self, job: Job) -> None:
        """Books a request that left the scheduler; the shards forget it before the next step."""
        self.trace.finish(job.request)
        self.to_filter.append(job.id)
        del self.jobs[job.id]
        if job.finish_reason is None:
            log.info("request %d cancelled by its client", job.id)
        metrics.observe_retired(job)

    async def _filter(self) -> bool:
        if not self.to_filter:
            return True
        ids, self.to_filter = self.to_filter, []
        try:
            await self.shards.filter(ids)
            return True
        except ShardError as e:
            await self._fail_all(str(e))
            return False

    async def _move(self, step: Step) -> None:
        """Before the step runs: soft-reset requests leave the shards (they come back as new ones), offloaded
        blocks go to the swap pool and restored ones come back."""
        if step.preempted:
            log.info("soft reset of %d request(s) to free KV blocks: %s (they resume from their history)",
                     len(step.preempted), [r.id for r in step.preempted])
            for r in step.preempted:
                self.jobs[r.id].prefill_logprobs.clear()  # recomputed from the first token
            await self.shards.filter([r.id for r in step.preempted])
        if step.offloaded:
            log.info("offloaded %d request(s) to host memory: %s (%d blocks)", len(step.offloaded),
                     [r.id for r in step.offloaded], len(step.to_cpu))
        if step.restored:
            log.info("restored %d request(s) from host memory: %s (%d blocks)", len(step.restored),
                     [r.id for r in step.restored], len(step.to_device))
        metrics.observe_moves(step)
        if step.to_cpu or step.to_device:
            await self.shards.offload(step)

    def observe(self) -> None:
        kv = self.scheduler.kv
        new_lookups = kv.prefix_lookups - self._seen_lookups
        if new_lookups:
            metrics.observe_prefix_hits(new_lookups, kv.prefix_hit_blocks - self._seen_hits, kv.block_size)
        self._seen_lookups, self._seen_hits = kv.prefix_lookups, kv.prefix_hit_blocks
        metrics.observe_scheduler(self.scheduler)

    async def _fail_all(self, message: str) -> None:
        """A failed step poisons every running batch: fail the affected jobs (offloaded ones too: the shards
        forget their state) and clear every shard. A request that had already finished keeps its result."""
        log.error("step failed: %s", message)
        self.last_step_failed = True
        s = self.scheduler
        for job in list(self.jobs.values()):
            req = job.request
            if req.state is State.FINISHED and job.finish_reason is not None:
                self._retire(job)
            elif req.state is State.FINISHED or req in s.running or req in s.offloaded:
                job.fail(message)
                s.finish(req, "error")
                del self.jobs[job.id]
                metrics.outcomes.labels("error").inc()
        self.to_filter = []
        s.kv.forget()
        try:
            await self.shards.clear()
        except ShardError as e:
            log.error("clearing the shards failed too: %s", e)
