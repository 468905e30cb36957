"""The batching loop: one step at a time, in the same asyncio loop as the HTTP server.

Each step: retire cancelled requests, let the scheduler decide what runs, make the shards forget soft-reset and
retired requests and move offloaded or restored blocks, run the step on every shard, then hand its tokens to the
scheduler (`update`: tokens join requests; a stop token or max_new_tokens ends one).

The text work overlaps the forward: a step's tokens are detokenized, matched against stop sequences and streamed
while the next step computes, so none of it sits between two steps. A request a stop sequence ends then already
has a token in the step in flight; it finishes at once (its blocks freed, the shards told before the next step)
and that token is discarded. EOS and max_new_tokens are known before the next step is planned, so nothing is ever
computed or sent past them.

When a shard fails (it died, hangs, or missed a call's deadline) the engine does not fail the requests: every one
goes back to waiting with its tokens, a new shard set is started (router/recovery.py), and they resume from their
history, as after a soft reset. When every shard is alive and a step still fails, that step's own requests fail.
"""
import asyncio
import logging
import time
from typing import Optional

from proto import generate_pb2 as pb
from router import metrics
from router.core.request import State
from router.core.scheduler import Scheduler
from router.core.step import Outcome, Step
from router.job import Job
from router.recovery import Recovery, RecoveryError
from router.shards import ShardError, Shards
from router.trace import Trace

log = logging.getLogger("router")
PROBE_INTERVAL = 2.0  # s between Health calls while idle: a shard that dies or hangs is noticed without traffic
SEND_TURNS = 3  # event-loop turns before the last step's streams run: a gRPC call leaves on the second (measured)


class Engine:
    def __init__(self, shards: Shards, scheduler: Scheduler, trace: Optional[Trace] = None,
                 recovery: Optional[Recovery] = None):
        self.shards = shards
        self.scheduler = scheduler
        self.trace = trace or Trace(None)
        self.recovery = recovery  # None: a failed shard set fails its requests (nothing can replace it)
        self.jobs: dict[int, Job] = {}
        self.wake = asyncio.Event()
        self.to_filter: list[int] = []
        self.unstreamed: list[tuple[Job, object, bool]] = []  # the last step's (job, generation, its last), applied
        self.in_flight: set[int] = set()  # the requests sampling in the step the shards are computing
        self._seen_lookups = self._seen_hits = 0
        self.recovering = False
        self.failed = False  # the shards failed and were not replaced; cleared by the next answer
        self.answered_at: Optional[float] = None  # when the last step's answer came, while requests run

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

    @property
    def healthy(self) -> bool:
        """Every shard answered within the current deadline, and none is being replaced."""
        deadline = self.shards.deadline
        return not (self.recovering or self.failed) and deadline.silent_for < deadline.seconds

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
            for job in [j for j in self.jobs.values() if j.cancelled and j.request.state is not State.FINISHED]:
                self.scheduler.finish(job.request)
                self._left(job.request)
                self._retire(job)
            if not await self._filter():
                continue
            self.observe()
            if not self.busy:
                self._stream()
                await self._idle()
                continue
            began = time.perf_counter()
            step = self.scheduler.schedule()
            metrics.observe_planned(step, self.jobs)  # first steps end queue times (before the step runs)
            self.trace.step(step)
            planning = time.perf_counter() - began
            try:
                await self._move(step)
                if not step.entries:
                    self._stream()
                    await self._idle()
                    continue
                self._observe_gap()
                sent = time.perf_counter()
                resp = await self._run(step)
            except ShardError as e:
                await self._shard_failed(e, step)
                continue
            self.answered_at = time.perf_counter()
            self.failed = False
            metrics.observe_step(step, resp)
            took = self.answered_at - sent
            self.trace.ran(took)
            self._apply(step, resp, Outcome(seconds=took))
            metrics.router_step.observe(planning + time.perf_counter() - self.answered_at)

    async def _run(self, step: Step):
        """Runs the step on the shards and, while they compute it, streams the previous step's tokens."""
        call = asyncio.ensure_future(self.shards.step(step, self.jobs))
        self.in_flight = {e.request.id for e in step.entries if e.sample}
        for _ in range(SEND_TURNS):  # let the call reach the shards before the loop turns to the streams
            await asyncio.sleep(0)
        self._stream()
        try:
            return await call
        finally:
            self.in_flight = set()

    def _observe_gap(self) -> None:
        """The shards' idle time between two steps while requests run: the router's work, its other calls."""
        if self.answered_at is not None:
            metrics.step_gap.observe(time.perf_counter() - self.answered_at)

    async def _idle(self) -> None:
        """Waits for work; every PROBE_INTERVAL without any, checks that the shards still answer."""
        self.answered_at = None  # waiting for work is not a gap between steps
        self.wake.clear()
        try:
            await asyncio.wait_for(self.wake.wait(), PROBE_INTERVAL)
        except asyncio.TimeoutError:
            try:
                await self.shards.health()
                self.failed = False
            except ShardError as e:
                if not await self.shards.alive():  # a second miss in a row: hung or gone
                    await self._shard_failed(e)

    def _apply(self, step: Step, resp, outcome: Outcome) -> None:
        """The step's outcome (its time already in `outcome`): prompt logprobs, then the tokens, through the
        scheduler; their text and streams wait for the next step to be sent (`_stream`)."""
        for p in resp.prefill:
            if p.id in self.jobs:
                self.jobs[p.id].on_prefill(p.logprobs)
        given = {}
        for g in resp.generations:
            job = self.jobs.get(g.id)
            if job is not None and job.request.state is not State.FINISHED:
                outcome.tokens[g.id] = g.token_id
                if g.more_tokens:
                    outcome.more[g.id] = list(g.more_tokens)
                given[g.id] = (job, g, len(job.request.generated))
        for req in self.scheduler.update(step, outcome):
            self._left(req)
        for job, g, before in given.values():  # what update gave each request: one token, or more (speculation)
            added = len(job.request.generated) - before
            gens = [g] + [pb.Generation(id=g.id, token_id=t, logprob=lp)
                          for t, lp in zip(g.more_tokens, g.more_logprobs)][:max(0, added - 1)]
            self.unstreamed.extend((job, x, i == len(gens) - 1) for i, x in enumerate(gens))
            job.skipped_tokens += len(gens) - 1
        metrics.observe_speculation(step, outcome)
        self._constrain(outcome.tokens)

    def _constrain(self, tokens: dict[int, int]) -> None:
        """Constrained requests' matchers take their new tokens (router/grammar.py). One whose grammar is complete
        ends now (only EOS could follow); one given a token its grammar refused (possible only when every allowed
        token had an impossible logit) ends too, rather than run on unconstrained."""
        for rid, token in tokens.items():
            job = self.jobs.get(rid)
            if job is None or job.constraint is None:
                continue
            accepted = job.constraint.accept(token)
            if job.request.state is State.FINISHED or (accepted and not job.constraint.complete):
                continue
            if not accepted:
                log.warning("request %d: its grammar refused token %d; it ends here", rid, token)
            self.scheduler.finish(job.request, "eos_token")
            self._left(job.request)

    def _stream(self) -> None:
        """The last step's tokens to their jobs: text pieces, stop sequences, events. A request a stop sequence
        ends leaves the scheduler here; if it samples in the step in flight, that token is discarded."""
        unstreamed, self.unstreamed = self.unstreamed, []
        for job, g, last in unstreamed:
            if self.jobs.get(job.id) is not job:  # failed or ended meanwhile
                continue
            piece = job.detokenizer.add(g.token_id)
            req = job.request
            if (not last or req.finish_reason in (None, "length")) and job.detokenizer.stopped(piece):
                if req.state is State.FINISHED:  # a later (or its last) token ended it too: the stop sequence wins
                    req.finish_reason = "stop_sequence"
                else:
                    self.scheduler.finish(req, "stop_sequence")
                    self._left(req, discarded=int(req.id in self.in_flight))
                last = True
            job.on_token(g, piece, last)
            if job.finish_reason is not None:
                self._retire(job)

    def _left(self, req, discarded: int = 0) -> None:
        """A request left the scheduler: the shards forget it before the next step; the trace books the tokens
        it was given steps for (`discarded`: one more, sampled in the step in flight and dropped)."""
        self.to_filter.append(req.id)
        self.trace.finish(req, discarded)

    def _retire(self, job: Job) -> None:
        """Books a job that is done: its last token streamed, or its client gone."""
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
            await self._shard_failed(e)
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

    async def _shard_failed(self, error: ShardError, step: Optional[Step] = None) -> None:
        """A shard call failed. A dead, hung or late shard set is replaced and every request resumes; when every
        shard is alive and answered in time, the step itself failed: its requests fail, the others resume."""
        alive = not error.missed_deadline and await self.shards.alive()
        if not alive and self.recovery is not None:
            await self._recover(str(error))
            return
        self.failed = not alive
        if alive and step is not None and step.entries:
            await self._fail(f"a shard failed this step: {error}", {e.request.id for e in step.entries})
        else:
            await self._fail(str(error))

    async def _recover(self, message: str) -> None:
        log.error("shard failure (%s): replacing the shard set", message)
        self.recovering = True
        self._reset_all()
        try:
            await self.recovery.restart()
        except (RecoveryError, ShardError) as e:
            self.recovering, self.failed = False, True
            await self._fail(f"the shards failed and could not be replaced: {e}")
            return
        self.recovering = self.failed = False
        metrics.shard_restarts.inc()
        log.info("shard set replaced; %d request(s) resume from their history", len(self.jobs))

    def _reset_all(self) -> list:
        """Every request holding cache state waits again with its tokens (the shards lost their caches)."""
        reset = self.scheduler.reset_all()
        for req in reset:
            self.jobs[req.id].prefill_logprobs.clear()  # recomputed from the first token
        self.to_filter = []
        return reset

    async def _fail(self, message: str, victims: Optional[set[int]] = None) -> None:
        """Fails the `victims` (default: every request holding cache state), resets the other requests holding
        cache state and clears every shard."""
        log.error("step failed: %s", message)
        held = {r.id for r in self.scheduler.running + self.scheduler.offloaded}
        self._end([j for j in self.jobs.values() if j.id in (held if victims is None else victims)], message)
        self._reset_all()
        try:
            await self.shards.clear()
        except ShardError as e:
            log.error("clearing the shards failed too: %s", e)

    def end_all(self, message: str) -> None:
        """Shutdown: every request still here (running, waiting or offloaded) ends with an error event."""
        self._end(list(self.jobs.values()), message)

    def _end(self, jobs: list[Job], message: str) -> None:
        """These requests end with an error event and leave the scheduler."""
        for job in jobs:
            job.fail(message)
            self.scheduler.finish(job.request, "error")
            del self.jobs[job.id]
            metrics.outcome("error")

    async def _fail_all(self, message: str) -> None:
        """A bug in the loop: every job in flight fails (one that had already finished keeps its result)."""
        for job in [j for j in self.jobs.values() if j.request.state is State.FINISHED and j.finish_reason]:
            self._retire(job)
        s = self.scheduler
        await self._fail(message, {j.id for j in self.jobs.values()
                                   if j.request.state is State.FINISHED or j.request in s.running + s.offloaded})
