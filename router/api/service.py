"""What every HTTP surface (TGI's, OpenAI's) shares: admission, validation, submission, and following a
job's events while noticing when the client goes away."""
import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator, Optional

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
        arrived = time.monotonic()
        metrics.requests.inc()
        if self.draining:
            metrics.outcome("unhealthy")
            raise APIError(503, "the server is shutting down", "unhealthy")
        if self.validating + len(self.engine.jobs) >= self.max_concurrent_requests:
            metrics.outcome("overloaded")
            raise APIError(429, "Model is overloaded", "overloaded")
        self.validating += 1
        try:
            v, constraint = await asyncio.to_thread(self._validate, body)
        except ValidationError as e:
            metrics.outcome("validation")
            raise APIError(422, str(e), "validation") from e
        finally:
            self.validating -= 1
        job = Job(
            request=Request(prompt_ids=v.input_ids, max_new_tokens=v.max_new_tokens,
                            priority=body.parameters.priority,
                            stop_ids=frozenset() if body.parameters.ignore_eos else self.eos_ids,
                            reuse_prefix=not body.parameters.decoder_input_details),
            parameters=v.sampling,
            detokenizer=Detokenizer(self.tokenizer, v.input_ids[-5:], v.stop),
            special_ids=frozenset(self.tokenizer.all_special_ids), seed=v.seed, constraint=constraint,
            arrived_at=arrived,
        )
        metrics.validation_duration.observe(job.queued_at - arrived)
        metrics.input_length.observe(len(v.input_ids))
        metrics.max_new_tokens.observe(v.max_new_tokens)
        self.engine.submit(job)
        return job

    def _validate(self, body: GenerateRequest) -> tuple[Validated, Optional[Constraint]]:
        """Validation, then the grammar's compile (bounded: router/grammar.py's LIMITS), in a worker thread."""
        v = validate(body, self.tokenizer, self.limits)
        if v.grammar is None:
            return v, None
        if self.grammars is None:
            raise ValidationError("`grammar`: constrained decoding is not available on this server")
        try:
            return v, self.grammars.compile(v.grammar)
        except GrammarError as e:
            raise ValidationError(f"`grammar`: {e}") from None

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


async def _watch(job: Job, http, interval: float = 0.25) -> None:
    """Non-streaming responses get no disconnect signal of their own: poll for it."""
    while not await http.is_disconnected():
        await asyncio.sleep(interval)
    job.events.put_nowait(("gone", None))
