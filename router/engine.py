"""The batching loop: one step at a time, in the same asyncio loop as the HTTP server.

Each step: retire finished or cancelled requests (FilterBatch), let the scheduler decide what runs, make the
shards forget soft-reset requests (FilterBatch) and move offloaded or restored blocks (Offload), send the step to
every shard (Prefill when prompt tokens are in it, else Decode), and hand each sampled token to its job.
"""
import asyncio
import logging
from typing import Optional

from proto import generate_pb2 as pb
from router import metrics
from router.job import Job
from router.scheduler import Scheduler
from router.step import Entry, Step
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
        s = self.scheduler
        return bool(s.running or s.waiting or s.offloaded)

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

    def observe(self) -> None:
        s = self.scheduler
        new_lookups = s.prefix_lookups - self._seen_lookups
        new_hits = s.prefix_hit_blocks - self._seen_hits
        if new_lookups:
            metrics.prefix_lookups.inc(new_lookups)
            metrics.prefix_hit_blocks.inc(new_hits)
            metrics.prefix_hit_tokens.inc(new_hits * s.blocks.block_size)
        self._seen_lookups, self._seen_hits = s.prefix_lookups, s.prefix_hit_blocks
        metrics.batch_size.set(len(s.running))
        metrics.queue_size.set(len(s.waiting))
        metrics.blocks_free.set(s.blocks.num_free)
        metrics.blocks_total.set(s.blocks.num_blocks)
        metrics.offloaded_requests.set(len(s.offloaded))
        if s.swap is not None:
            metrics.swap_free.set(s.swap.num_free)
            metrics.swap_total.set(s.swap.num_blocks)
        if s.window is not None:
            metrics.window_blocks_free.set(s.window.blocks.num_free)
            metrics.window_blocks_total.set(s.window.blocks.num_blocks)

    async def _loop(self) -> None:
        while True:
            await self._retire()
            self.observe()
            if not self.busy:
                self.wake.clear()
                await self.wake.wait()
                continue
            step = self.scheduler.schedule()
            self.trace.step(step)
            try:
                await self._move(step)
            except ShardError as e:
                await self._fail_all(str(e))
                continue
            if not step.entries:
                self.wake.clear()
                await self.wake.wait()
                continue
            try:
                resp = await self.shards.step(step.has_prefill, [self._entry(e) for e in step.entries])
            except ShardError as e:
                await self._fail_all(str(e))
                continue
            self.last_step_failed = False
            metrics.computed_tokens.inc(resp.tokens)
            metrics.prefill_chunks.inc(sum(1 for e in step.entries if not e.decode and not e.sample))
            metrics.forward_duration.labels("prefill" if step.has_prefill else "decode").observe(resp.forward_ns / 1e9)
            for p in resp.prefill:
                if p.id in self.jobs:
                    self.jobs[p.id].on_prefill(p.logprobs)
            for g in resp.generations:
                job = self.jobs.get(g.id)
                if job is not None and job.finish_reason is None:
                    job.on_token(g)

    async def _move(self, step: Step) -> None:
        """Before the step runs: soft-reset requests leave the shards (they come back as new ones), offloaded
        blocks go to the swap pool and restored ones come back."""
        if step.preempted:
            log.info("soft reset of %d request(s) to free KV blocks: %s (they resume from their history)",
                     len(step.preempted), [r.id for r in step.preempted])
            metrics.preemptions.inc(len(step.preempted))
            for r in step.preempted:
                self.jobs[r.id].prefill_logprobs.clear()  # recomputed from the first token
            await self.shards.filter([r.id for r in step.preempted])
        if step.offloaded:
            log.info("offloaded %d request(s) to host memory: %s (%d blocks)", len(step.offloaded),
                     [r.id for r in step.offloaded], len(step.to_cpu))
            metrics.offloads.inc(len(step.offloaded))
            metrics.offloaded_blocks.inc(len(step.to_cpu))
        if step.restored:
            log.info("restored %d request(s) from host memory: %s (%d blocks)", len(step.restored),
                     [r.id for r in step.restored], len(step.to_device))
            metrics.restores.inc(len(step.restored))
            metrics.restored_blocks.inc(len(step.to_device))
        if step.to_cpu or step.to_device:
            await self.shards.offload(pb.OffloadRequest(
                to_cpu=[pb.BlockCopy(src=b, dst=s) for b, s in step.to_cpu],
                to_device=[pb.BlockCopy(src=s, dst=b) for s, b in step.to_device],
                tables=[pb.RequestBlocks(id=i, blocks=blocks) for i, blocks in step.tables.items()]))

    def _entry(self, e: Entry) -> pb.StepEntry:
        job = self.jobs[e.request.id]
        return pb.StepEntry(
            id=e.request.id, input_ids=e.request.tokens[e.start:e.start + e.num_tokens], new_blocks=e.new_blocks,
            sample=e.sample, cached_tokens=e.start, parameters=job.parameters if e.first else None,
            prompt_tokens=len(e.request.prompt_ids) if e.first else 0,
            new_window_blocks=e.new_window_blocks, window_dropped=e.window_dropped,
        )

    async def _retire(self) -> None:
        for job in list(self.jobs.values()):
            if job.finish_reason is not None or job.cancelled:
                self.scheduler.finish(job.request)
                self.trace.finish(job.request)
                self.to_filter.append(job.id)
                del self.jobs[job.id]
                if job.cancelled and job.finish_reason is None:
                    log.info("request %d cancelled by its client", job.id)
                    metrics.outcomes.labels("cancelled").inc()
                else:
                    metrics.outcomes.labels("success").inc()
                    metrics.generated_tokens.observe(len(job.tokens))
                    metrics.request_duration.observe(job.finished_at - job.queued_at)
                    metrics.queue_duration.observe(job.first_token_at - job.queued_at)
                    metrics.inference_duration.observe(job.finished_at - job.first_token_at)
                    metrics.time_per_token.observe((job.finished_at - job.queued_at) / max(1, len(job.tokens)))
        if self.to_filter:
            ids, self.to_filter = self.to_filter, []
            try:
                await self.shards.filter(ids)
            except ShardError as e:
                await self._fail_all(str(e))

    async def _fail_all(self, message: str) -> None:
        """A failed step poisons every running batch: fail the affected jobs (offloaded ones too: the shards
        forget their state) and clear every shard."""
        log.error("step failed: %s", message)
        self.last_step_failed = True
        for job in list(self.jobs.values()):
            if job.request in self.scheduler.running or job.request in self.scheduler.offloaded:
                job.fail(message)
                metrics.outcomes.labels("error").inc()
                self.scheduler.finish(job.request)
                del self.jobs[job.id]
        self.to_filter = []
        self.scheduler.blocks.forget()
        try:
            await self.shards.clear()
        except ShardError as e:
            log.error("clearing the shards failed too: %s", e)
