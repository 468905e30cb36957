"""What every HTTP surface (TGI's, OpenAI's) shares: admission, validation, submission, and following a
job's events while noticing when the client goes away."""
import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator, Optional

from proto import generate_pb2 as pb
from router import metrics
from router.api.errors import APIError
from router.api.info import Info
from router.api.validation import GenerateRequest, Limits, Validated, ValidationError, validate
from router.core.request import Request
from router.detokenizer import Detokenizer
from router.engine import Engine
from router.grammar import Constraint, GrammarError, Grammars
from router.job import Job
from router.shards import ShardError


@dataclass
class Service:
    tokenizer: object
    limits: Limits
    eos_ids: frozenset
    max_concurrent_requests: int
    model_name: str  # what the user called the model, never a cache path
    engine: Optional[Engine] = None  # set once the shards are warmed up
    info: Optional[Info] = None
    draining: bool = False
    validating: int = 0  # requests admitted but still being tokenized: they count against the limit too
    grammars: Optional[Grammars] = None  # constrained decoding (None: requests with a grammar are refused)

    async def start(self, body: GenerateRequest) -> Job:
        """Validates and queues a request, or raises APIError (503 draining, 429 overloaded, 422 invalid).
        Tokenizing runs in a worker thread, so a long prompt never stalls the batching loop."""
        return (await self.start_choices(body, 1))[0]

    async def start_choices(self, body: GenerateRequest, n: int) -> list[Job]:
        """n choices of one prompt (OpenAI's n, best_of): validated and tokenized once, each its own request;
        choice i samples with seed + i, so it equals a single request with that seed; the later choices wait
        for the first's prompt to be cached and share its blocks (Request.after). Each counts against
        --max-concurrent-requests."""
        arrived = time.monotonic()
        metrics.requests.inc(n)
        if self.draining:
            metrics.outcome("unhealthy", n)
            raise APIError(503, "the server is shutting down", "unhealthy")
        if self.validating + len(self.engine.jobs) + n > self.max_concurrent_requests:
            metrics.outcome("overloaded", n)
            raise APIError(429, "Model is overloaded", "overloaded")
        self.validating += n
        try:
            v, constraints = await asyncio.to_thread(self._validate, body, n)
        except ValidationError as e:
            metrics.outcome("validation", n)
            raise APIError(422, str(e), "validation") from e
        finally:
            self.validating -= n
        jobs: list[Job] = []
        for i, constraint in enumerate(constraints):
            seed = None if v.seed is None else (v.seed + i) % 2**64
            sampling = pb.SamplingParameters()
            sampling.CopyFrom(v.sampling)
            sampling.seed = seed or 0
            jobs.append(Job(
                request=Request(prompt_ids=v.input_ids, max_new_tokens=v.max_new_tokens,
                                priority=body.parameters.priority,
                                stop_ids=frozenset() if body.parameters.ignore_eos else self.eos_ids,
                                reuse_prefix=not body.parameters.decoder_input_details,
                                after=jobs[0].request if jobs else None, speculate=may_speculate(v, constraint)),
                parameters=sampling,
                detokenizer=Detokenizer(self.tokenizer, v.input_ids[-5:], v.stop),
                special_ids=frozenset(self.tokenizer.all_special_ids), seed=seed, constraint=constraint,
                arrived_at=arrived,
            ))
        for job in jobs:
            metrics.validation_duration.observe(job.queued_at - arrived)
            metrics.input_length.observe(len(v.input_ids))
            metrics.max_new_tokens.observe(v.max_new_tokens)
            self.engine.submit(job)
        return jobs

    def _validate(self, body: GenerateRequest, n: int = 1) -> tuple[Validated, list[Optional[Constraint]]]:
        """Validation, then the grammar's compile (bounded: router/grammar.py's LIMITS) and a matcher for each of
        the n choices, in a worker thread."""
        v = validate(body, self.tokenizer, self.limits)
        if v.grammar is None:
            return v, [None] * n
        if self.grammars is None:
            raise ValidationError("`grammar`: constrained decoding is not available on this server")
        try:
            return v, [self.grammars.compile(v.grammar) for _ in range(n)]
        except GrammarError as e:
            raise ValidationError(f"`grammar`: {e}") from None

    async def follow(self, jobs: list[Job], http) -> None:
        """Follows non-streamed jobs (one request's choices) to their end: an error event becomes a 424, a client
        gone a 499, and either cancels the other choices."""
        async def one(job: Job) -> None:
            async for kind, payload in self.events(job, http):
                if kind == "error":
                    raise APIError(424, payload, "generation")
            if job.finish_reason is None:
                raise APIError(499, "client closed the request", "cancelled")
        try:
            await asyncio.gather(*[one(job) for job in jobs])
        finally:
            for job in jobs:
                self.engine.cancel(job)

    async def current_info(self) -> Info:
        """/info, with the step sizes' compile as the shards report it now while it is not over (it runs in the
        background on a CPU shard: shard/compiling.py)."""
        info = self.info
        if info.compile_state in ("pending", "compiling"):
            try:
                health = await self.engine.shards.health()
            except ShardError:
                return info
            if health.compile_state:
                self.info = info = info.model_copy(update=dict(
                    compile_state=health.compile_state, compiled_step_sizes=list(health.compiled_sizes),
                    compile_seconds=round(health.compile_seconds, 1)))
        return info

    def text(self, job: Job) -> str:
        return self.tokenizer.decode(job.request.generated, skip_special_tokens=True)

    async def events(self, job: Job, http=None) -> AsyncIterator[tuple[str, object]]:
        """The job's events ("token", Token), then ("end", job) or ("error", message). Leaving early cancels
        the job (it leaves the batch at the next step); with `http` given, so does the client going away."""
        watcher = asyncio.create_task(_watch(job, http)) if http is not None else None
        try:
            while True:
                kind, payload = await job.events.get()
                if kind == "gone":
                    return
                yield kind, payload
                if kind != "token":
                    return
        finally:
            if watcher is not None:
                watcher.cancel()
            self.engine.cancel(job)


def may_speculate(v: Validated, constraint) -> bool:
    """Drafts are verified by plain sampling (shard/sampling.py verify): not under penalties, which would need
    each draft's history, top tokens, or a grammar's mask, which is one step's."""
    p = v.sampling
    return constraint is None and p.repetition_penalty in (0.0, 1.0) and not p.frequency_penalty and not p.top_n_tokens


async def _watch(job: Job, http, interval: float = 0.25) -> None:
    """Non-streaming responses get no disconnect signal of their own: poll for it."""
    while not await http.is_disconnected():
        await asyncio.sleep(interval)
    job.events.put_nowait(("gone", None))
