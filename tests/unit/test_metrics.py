"""Every metric on GET /metrics means what its name says, the `tgi_*` ones what TGI's router means (its
server.rs, queue.rs, backend.rs, infer/mod.rs): each is checked against a known timeline. The engine runs with
fake shards and a fake clock (router.job.clock for request timings, the engine's perf_counter for its own), so
every duration is exact; the registry is global, so each test reads how much its own scenario moved it."""
import asyncio
from types import SimpleNamespace

import pytest

from proto import generate_pb2 as pb
from router import engine as engine_module
from router import job as job_module
from router import metrics
from router.api import service as service_module
from router.api.errors import APIError
from router.api.service import Service
from router.api.validation import GenerateRequest, Limits, Parameters
from router.core.kv import KVManager
from router.core.request import Request
from router.core.scheduler import Budget, Scheduler
from router.core.step import Step
from router.detokenizer import Detokenizer
from router.engine import Engine
from router.job import Job
from router.shards import ShardError

from drive import req
from test_engine_failure import FlakyShards
from drive import step as step_once


class Clock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    """One fake clock for every timing: the jobs', the engine's and validation's."""
    c = Clock()
    monkeypatch.setattr(job_module, "clock", c)
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(perf_counter=c))
    monkeypatch.setattr(service_module, "time", SimpleNamespace(monotonic=c))
    return c


def _samples() -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in metrics.registry.collect() for s in family.samples}


class Delta:
    """How much each sample moved since it was made (other tests move the global registry too)."""

    def __init__(self):
        self.before = _samples()

    def __call__(self, name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return _samples().get(key, 0.0) - self.before.get(key, 0.0)


def gauge(name: str) -> float:
    return metrics.registry.get_sample_value(name)


class Tokenizer:
    all_special_ids = []

    def __init__(self, clock: Clock = None, seconds: float = 0.0):
        self.clock, self.seconds = clock, seconds

    def __call__(self, text, add_special_tokens=True):
        """Tokenizing takes `seconds` of the fake clock."""
        self.clock.now += self.seconds
        return {"input_ids": list(range(1, len(text) + 1))}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"<{i}>" for i in ids)


class Shards(FlakyShards):
    """Each step takes `forward` seconds of the fake clock, spent as the call starts (so the previous step's
    tokens stream at its end) and reported as the shard's forward_ns; answers 7 + tokens so far. Records when each
    step was sent, what it carried and the gauges then. `die_at` a step number: the shard set dies there."""

    def __init__(self, clock: Clock, forward: float = 1.0, compiled=lambda step: False):
        super().__init__()
        self.clock, self.forward, self.compiled = clock, forward, compiled
        self.sent: list[tuple[float, Step, dict]] = []
        self.die_at = None

    async def step(self, step, jobs):
        seen = {n: gauge(n) for n in ("tgi_batch_current_size", "tgi_queue_size", "tgi_batch_current_max_tokens")}
        self.sent.append((self.clock.now, step, seen))
        self.clock.now += self.forward
        self.dead = self.dead or len(self.sent) == self.die_at
        if self.broken or self.dead:
            raise ShardError("Decode: UNAVAILABLE: shard 1 went away")
        return pb.StepResponse(generations=[pb.Generation(id=e.request.id, token_id=7 + len(e.request.generated))
                                            for e in step.entries if e.sample],
                               forward_ns=round(self.forward * 1e9), tokens=sum(e.num_tokens for e in step.entries),
                               compiled=self.compiled(step))

    async def offload(self, step):
        pass

    def first_steps(self, j: Job) -> list[float]:
        """When each step that was the request's first since it joined the queue was sent."""
        return [t for t, step, _ in self.sent for e in step.entries if e.request.id == j.id and e.first]


class Replacement:
    """Stands for router/recovery.py: "starts a new shard set" by healing the fake one."""

    def __init__(self, shards: Shards):
        self.shards = shards

    async def restart(self):
        self.shards.dead = False


def start(clock: Clock, kv: KVManager = None, budget: Budget = None, recovery: bool = False, scheduler=Scheduler,
          **shards):
    fake, kv = Shards(clock, **shards), kv or KVManager(64, 4)
    engine = Engine(fake, scheduler(budget or Budget(32, 256, 8, 0.3, 20), kv),
                    recovery=Replacement(fake) if recovery else None)
    return fake, kv, engine, asyncio.create_task(engine.run())


def job(n_prompt: int, n_new: int, **timings) -> Job:
    return Job(Request(list(range(1, n_prompt + 1)), n_new), pb.SamplingParameters(),
               Detokenizer(Tokenizer(), [], []), frozenset(), **timings)


async def drain(j: Job) -> list:
    out = []
    while not out or out[-1][0] == "token":
        out.append(await asyncio.wait_for(j.events.get(), 10))
    return out


# The request timings: arrival, queued (validated), first scheduled step, last token ------------------------

def test_request_durations_split_where_tgi_splits_them(clock):
    """Validated at 100 (arrived at 99.5), first step at 102, one step a second, three tokens: the queue time
    ends at the first step (not at the first token, 104), the inference time runs from there to the end."""
    async def scenario():
        shards, kv, engine, loop = start(clock)
        d = Delta()
        j = job(3, 3, arrived_at=99.5)
        engine.submit(j)
        clock.now = 102.0
        assert (await drain(j))[-1][0] == "end"
        assert (j.queued_at, j.scheduled_at, j.first_token_at, j.finished_at) == (100.0, 102.0, 104.0, 105.0)
        assert d("tgi_request_duration_count") == 1 and d("tgi_request_duration_sum") == pytest.approx(5.5)
        assert d("tgi_request_queue_duration_count") == 1
        assert d("tgi_request_queue_duration_sum") == pytest.approx(2.0)
        assert d("tgi_request_inference_duration_sum") == pytest.approx(3.0)
        assert d("tgi_request_mean_time_per_token_duration_sum") == pytest.approx(1.0)
        assert d("tgi_request_generated_tokens_count") == 1 and d("tgi_request_generated_tokens_sum") == 3
        assert d("tgi_request_success_total") == 1 and d("tgi_request_outcome_total", outcome="success") == 1
        loop.cancel()

    asyncio.run(scenario())


def test_a_soft_reset_request_keeps_its_first_step_as_the_end_of_its_queue_time(clock):
    """Two requests outgrow a 4-block pool; the later one is soft-reset, waits, and is admitted again. Its queue
    time is still to its first step; the wait after the reset is inference time."""
    async def scenario():
        clock.now = 98.0
        a, b = job(4, 10), job(4, 10)
        shards, kv, engine, loop = start(clock, kv=KVManager(4, 4))
        d = Delta()
        engine.submit(a)
        engine.submit(b)
        clock.now = 100.0
        for j in (a, b):
            assert (await drain(j))[-1][0] == "end"
        firsts = shards.first_steps(b)
        assert b.request.preemptions >= 1 and len(firsts) == 1 + b.request.preemptions and firsts[0] == 100.0
        assert d("cb_preemptions_total") == sum(len(s.preempted) for _, s, _ in shards.sent) >= 1
        assert b.scheduled_at == 100.0 and d("tgi_request_queue_duration_count") == 2
        assert d("tgi_request_queue_duration_sum") == pytest.approx(2.0 + 2.0)
        assert d("tgi_request_inference_duration_sum") == pytest.approx(a.finished_at - 100 + b.finished_at - 100)
        assert d("tgi_request_mean_time_per_token_duration_sum") == pytest.approx(
            (a.finished_at - 100) / 10 + (b.finished_at - 100) / 10)
        loop.cancel()

    asyncio.run(scenario())


def test_requests_resumed_after_a_shard_restart_keep_their_first_step(clock):
    """The shard set dies at the third step and is replaced; both requests resume from their history. Their
    queue time is still to their first step; the failed step counts as sent, not answered."""
    async def scenario():
        clock.now = 98.0
        jobs = [job(5, 6), job(3, 6)]
        shards, kv, engine, loop = start(clock, recovery=True)
        shards.die_at = 3
        d = Delta()
        for j in jobs:
            engine.submit(j)
        clock.now = 100.0
        for j in jobs:
            assert (await drain(j))[-1][0] == "end"
            assert j.scheduled_at == 100.0 and len(shards.first_steps(j)) == 2
        assert d("cb_shard_restarts_total") == 1
        assert d("tgi_request_queue_duration_count") == 2
        assert d("tgi_request_queue_duration_sum") == pytest.approx(4.0)
        assert d("tgi_request_inference_duration_sum") == pytest.approx(sum(j.finished_at - 100 for j in jobs))
        sent = sum(d("tgi_batch_inference_count_total", method=m) for m in ("prefill", "decode"))
        answered = sum(d("tgi_batch_inference_success_total", method=m) for m in ("prefill", "decode"))
        assert sent == len(shards.sent) and answered == sent - 1
        assert d("tgi_request_success_total") == 2 and d("tgi_request_failure_total", err="generation") == 0
        loop.cancel()

    asyncio.run(scenario())


# How requests end: tgi_request_success, tgi_request_failure{err}, and cb's tgi_request_outcome{outcome} ----

def test_a_client_gone_is_a_dropped_failure_with_no_timings(clock):
    async def scenario():
        shards, kv, engine, loop = start(clock)
        d = Delta()
        j = job(3, 50)
        engine.submit(j)
        assert (await j.events.get())[0] == "token"
        engine.cancel(j)
        while j.id in engine.jobs:
            await asyncio.sleep(0)
        assert d("tgi_request_failure_total", err="dropped") == 1
        assert d("tgi_request_outcome_total", outcome="cancelled") == 1
        assert d("tgi_request_success_total") == 0 and d("tgi_request_duration_count") == 0
        loop.cancel()

    asyncio.run(scenario())


def test_a_failed_step_is_a_generation_failure(clock):
    async def scenario():
        shards, kv, engine, loop = start(clock)
        shards.broken = True
        d = Delta()
        jobs = [job(3, 5), job(4, 5)]
        for j in jobs:
            engine.submit(j)
        for j in jobs:
            assert (await drain(j))[-1][0] == "error"
        assert d("tgi_request_failure_total", err="generation") == 2
        assert d("tgi_request_outcome_total", outcome="error") == 2
        assert d("tgi_request_success_total") == 0 and d("tgi_request_queue_duration_count") == 0
        assert d("tgi_batch_inference_count_total", method="prefill") == 1
        assert d("tgi_batch_inference_success_total", method="prefill") == 0
        loop.cancel()

    asyncio.run(scenario())


# Validation: tgi_request_count, tgi_request_validation_duration, tgi_request_input_length, refusals ----------

LIMITS = Limits(max_input_tokens=100, max_total_tokens=200, vocab_size=1000, max_stop_sequences=4,
                max_top_n_tokens=5)


def service(clock: Clock, jobs: int = 0, draining: bool = False) -> tuple[Service, list]:
    """A service over a stub engine that holds `jobs` requests and keeps what is submitted; tokenizing takes
    0.004 s of the fake clock."""
    submitted = []
    engine = SimpleNamespace(jobs=dict.fromkeys(range(jobs)), submit=submitted.append)
    return Service(Tokenizer(clock, 0.004), LIMITS, frozenset(), 4, "m", engine=engine, draining=draining), submitted


def test_validation_duration_is_arrival_to_the_queue_and_input_length_the_prompt(clock):
    async def scenario():
        svc, submitted = service(clock)
        d = Delta()
        clock.now = 50.0
        j = await svc.start(GenerateRequest(inputs="hello", parameters=Parameters(max_new_tokens=5)))
        assert submitted == [j] and (j.arrived_at, j.queued_at) == (50.0, pytest.approx(50.004))
        assert d("tgi_request_count_total") == 1
        assert d("tgi_request_validation_duration_count") == 1
        assert d("tgi_request_validation_duration_sum") == pytest.approx(0.004)
        assert d("tgi_request_input_length_count") == 1 and d("tgi_request_input_length_sum") == 5
        assert d("tgi_request_max_new_tokens_count") == 1 and d("tgi_request_max_new_tokens_sum") == 5

    asyncio.run(scenario())


@pytest.mark.parametrize("jobs, draining, body, err", [
    (4, False, {"inputs": "hello"}, "overloaded"),
    (0, True, {"inputs": "hello"}, "unhealthy"),
    (0, False, {"inputs": "hello", "parameters": {"max_new_tokens": 500}}, "validation"),
])
def test_a_refused_request_is_counted_and_a_failure_by_its_err(clock, jobs, draining, body, err):
    async def scenario():
        svc, submitted = service(clock, jobs, draining)
        d = Delta()
        with pytest.raises(APIError):
            await svc.start(GenerateRequest(**body))
        assert not submitted and d("tgi_request_count_total") == 1
        assert d("tgi_request_failure_total", err=err) == 1 and d("tgi_request_outcome_total", outcome=err) == 1
        assert d("tgi_request_validation_duration_count") == 0

    asyncio.run(scenario())


# The batch: its size and tokens, the queue, the next batch, the steps ---------------------------------------

def test_the_batch_and_queue_gauges_and_the_next_batch_sizes(clock):
    """Three requests, two at a time: the gauges as each step is sent (set before it is planned), the batches
    taken from the queue (2, then 1) and the steps by method."""
    async def scenario():
        shards, kv, engine, loop = start(clock, budget=Budget(32, 256, 2, 0.3, 20))
        d = Delta()
        jobs = [job(3, 2), job(4, 2), job(5, 2)]
        for j in jobs:
            engine.submit(j)
        for j in jobs:
            assert (await drain(j))[-1][0] == "end"
        seen = [(g["tgi_batch_current_size"], g["tgi_queue_size"], g["tgi_batch_current_max_tokens"])
                for _, _, g in shards.sent]
        assert seen == [(0, 3, 0), (2, 1, 3 + 4), (0, 1, 0), (1, 0, 5)]
        await asyncio.sleep(0.01)  # the loop goes idle
        assert (gauge("tgi_batch_current_size"), gauge("tgi_queue_size")) == (0, 0)
        assert d("tgi_batch_next_size_count") == 2 and d("tgi_batch_next_size_sum") == 3
        assert d("tgi_batch_inference_count_total", method="prefill") == 2
        assert d("tgi_batch_inference_count_total", method="decode") == 2
        assert d("tgi_batch_inference_success_total", method="prefill") == 2
        assert d("tgi_batch_inference_success_total", method="decode") == 2
        loop.cancel()

    asyncio.run(scenario())


def test_forward_duration_by_method_and_what_the_steps_computed(clock):
    """A 10-token prompt in chunks of 4 (4, 4, 2: the last samples), then two decodes; each forward takes 0.5 s
    and the decodes run compiled."""
    async def scenario():
        shards, kv, engine, loop = start(clock, budget=Budget(4, 256, 8, 0.3, 20), forward=0.5,
                                         compiled=lambda step: not step.has_prefill)
        d = Delta()
        j = job(10, 3)
        engine.submit(j)
        assert (await drain(j))[-1][0] == "end"
        assert [[e.num_tokens for e in s.entries] for _, s, _ in shards.sent] == [[4], [4], [2], [1], [1]]
        assert d("tgi_batch_forward_duration_count", method="prefill") == 3
        assert d("tgi_batch_forward_duration_sum", method="prefill") == pytest.approx(1.5)
        assert d("tgi_batch_forward_duration_count", method="decode") == 2
        assert d("tgi_batch_forward_duration_sum", method="decode") == pytest.approx(1.0)
        assert d("cb_forward_steps_total", path="eager") == 3 and d("cb_forward_steps_total", path="compiled") == 2
        assert d("cb_prefill_chunks_total") == 2 and d("cb_computed_tokens_total") == 12
        assert d("tgi_batch_next_size_count") == 1 and d("tgi_batch_next_size_sum") == 1
        loop.cancel()

    asyncio.run(scenario())


def test_router_step_and_step_gap_on_a_known_timeline(clock):
    """Planning takes 2 ms and applying a step's tokens 1 ms: the router's work per step is 3 ms, and the shards
    wait 3 ms between a step's answer and the next call (none before the first step: they were idle)."""
    class Slow(Scheduler):
        def schedule(self):
            clock.now += 0.002
            return super().schedule()

        def update(self, step, outcome):
            clock.now += 0.001
            return super().update(step, outcome)

    async def scenario():
        shards, kv, engine, loop = start(clock, scheduler=Slow)
        d = Delta()
        j = job(3, 3)
        engine.submit(j)
        assert (await drain(j))[-1][0] == "end"
        assert len(shards.sent) == 3
        assert d("cb_router_step_seconds_count") == 3
        assert d("cb_router_step_seconds_sum") == pytest.approx(3 * 0.003)
        assert d("cb_step_gap_seconds_count") == 2 and d("cb_step_gap_seconds_sum") == pytest.approx(2 * 0.003)
        loop.cancel()

    asyncio.run(scenario())


def test_offloads_and_restores_count_requests_and_blocks(clock):
    """As the soft-reset case, with a swap pool: the later request is offloaded, then restored."""
    async def scenario():
        shards, kv, engine, loop = start(clock, kv=KVManager(4, 4, swap_blocks=8))
        d = Delta()
        a, b = job(4, 10), job(4, 10)
        engine.submit(a)
        engine.submit(b)
        for j in (a, b):
            assert (await drain(j))[-1][0] == "end"
        steps = [s for _, s, _ in shards.sent]
        assert b.request.offloads >= 1 and b.request.preemptions == 0
        assert d("cb_offloads_total") == sum(len(s.offloaded) for s in steps) == a.request.offloads + b.request.offloads
        assert d("cb_offloaded_blocks_total") == sum(len(s.to_cpu) for s in steps) > 0
        assert d("cb_restores_total") == sum(len(s.restored) for s in steps) == d("cb_offloads_total")
        assert d("cb_restored_blocks_total") == sum(len(s.to_device) for s in steps) > 0
        assert d("cb_preemptions_total") == 0
        loop.cancel()

    asyncio.run(scenario())


def test_prefix_cache_counters(clock):
    """The same 9-token prompt twice, one after the other: two lookups, the second reuses its 2 full blocks."""
    async def scenario():
        shards, kv, engine, loop = start(clock, kv=KVManager(16, 4, prefix_caching=True))
        d = Delta()
        for _ in range(2):
            j = job(9, 2)
            engine.submit(j)
            assert (await drain(j))[-1][0] == "end"
        await asyncio.sleep(0.01)  # the loop reads the counters before it goes idle
        assert d("cb_prefix_cache_lookups_total") == 2
        assert d("cb_prefix_cache_hit_blocks_total") == 2 and d("cb_prefix_cache_hit_tokens_total") == 8
        assert d("cb_computed_tokens_total") == 9 + 1 + 1 + 1  # the second prompt: only its last token
        loop.cancel()

    asyncio.run(scenario())


def test_pool_gauges_read_the_pools():
    """A 5-token prompt holds 2 of 8 blocks; offloaded, it holds 2 of 4 swap slots and none of the pool."""
    s = Scheduler(Budget(64, 1000, 8, 0.0, 0), KVManager(8, 4, swap_blocks=4))
    r = req(5, 4)
    s.add(r)
    step_once(s)
    metrics.observe_scheduler(s)
    assert [gauge(n) for n in ("cb_kv_blocks_free", "cb_kv_blocks_total", "cb_swap_blocks_free",
                               "cb_swap_blocks_total", "cb_offloaded_requests", "tgi_batch_current_size",
                               "tgi_batch_current_max_tokens")] == [6, 8, 4, 4, 0, 1, 5]
    s.offload(r, Step())
    metrics.observe_scheduler(s)
    assert [gauge(n) for n in ("cb_kv_blocks_free", "cb_swap_blocks_free", "cb_offloaded_requests",
                               "tgi_batch_current_size", "tgi_batch_current_max_tokens")] == [8, 2, 1, 0, 0]


def test_window_pool_gauges_read_the_window_pool():
    """Hybrid models: a 5-token prompt under an 8-token window holds 2 of the window pool's 6 blocks."""
    s = Scheduler(Budget(64, 1000, 8, 0.0, 0), KVManager(8, 4, window=8, window_blocks=6))
    s.add(req(5, 4))
    step_once(s)
    metrics.observe_scheduler(s)
    assert (gauge("cb_window_blocks_free"), gauge("cb_window_blocks_total")) == (4, 6)
