"""A shard failing during a step: every request in the batch gets an error, the shards are cleared, the
block pool is whole again, and the next request is served. The engine is driven directly with a shard
client that fails on demand (no model needed: this is the router's own error path)."""
import asyncio

from proto import generate_pb2 as pb
from router.core.kv import KVManager
from router.core.request import Request
from router.core.scheduler import Budget, Scheduler
from router.detokenizer import Detokenizer
from router.deadline import Deadline
from router.engine import Engine
from router.job import Job
from router.shards import ShardError


class Tokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"<{i}>" for i in ids)


class FlakyShards:
    """Answers every step with token 7 for each sampled entry, except while `broken`; `dead` shards also stop
    answering Health."""

    def __init__(self):
        self.broken = self.dead = False
        self.cleared = self.steps = 0
        self.die_at_step = None
        self.deadline = Deadline(60.0)

    async def step(self, step, jobs):
        await asyncio.sleep(0)
        self.steps += 1
        self.dead = self.dead or self.steps == self.die_at_step
        if self.broken or self.dead:
            raise ShardError("Prefill: UNAVAILABLE: shard 1 went away")
        return pb.StepResponse(generations=[pb.Generation(id=e.request.id, token_id=7 + len(e.request.generated))
                                            for e in step.entries if e.sample])

    async def alive(self):
        return not self.dead

    async def health(self):
        if self.dead:
            raise ShardError("Health: UNAVAILABLE")

    async def filter(self, ids):
        pass

    async def clear(self):
        self.cleared += 1


def job(n_prompt: int, n_new: int) -> Job:
    return Job(Request(list(range(1, n_prompt + 1)), n_new), pb.SamplingParameters(),
               Detokenizer(Tokenizer(), [], []), frozenset())


async def drain(j: Job) -> list:
    out = []
    while not out or out[-1][0] == "token":
        out.append(await asyncio.wait_for(j.events.get(), 10))
    return out


class Replacement:
    """Stands for router/recovery.py: "starts a new shard set" by healing the fake one."""

    def __init__(self, shards: FlakyShards):
        self.shards, self.restarts = shards, 0

    async def restart(self):
        await asyncio.sleep(0.01)
        self.restarts += 1
        self.shards.dead = False


def start(recovery: bool = False):
    """A running engine over a 64-block pool and shards that fail on demand (inside an event loop)."""
    shards, kv = FlakyShards(), KVManager(64, 4)
    engine = Engine(shards, Scheduler(Budget(32, 256, 8, 0.3, 20), kv),
                    recovery=Replacement(shards) if recovery else None)
    return shards, kv, engine, asyncio.create_task(engine.run())


def test_failed_step_fails_the_batch_and_the_engine_keeps_serving():
    async def scenario():
        shards, kv, engine, loop = start()
        shards.broken = True
        victims = [job(5, 20), job(9, 20)]
        for v in victims:
            engine.submit(v)
        for v in victims:
            assert (await drain(v))[-1][0] == "error"
        assert shards.cleared >= 1 and kv.pool.num_free == 64 and not engine.scheduler.running
        shards.broken = False
        fine = job(3, 4)
        engine.submit(fine)
        events = await drain(fine)
        assert events[-1][0] == "end" and [e[1].id for e in events[:-1]] == [7, 8, 9, 10]
        await asyncio.sleep(0.05)
        assert kv.pool.num_free == 64
        loop.cancel()

    asyncio.run(scenario())


def test_a_dead_shard_set_is_replaced_and_every_request_resumes_from_its_history():
    async def scenario():
        shards, kv, engine, loop = start(recovery=True)
        shards.die_at_step = 5
        jobs = [job(5, 12), job(9, 12), job(3, 12)]
        for j in jobs:
            engine.submit(j)
        results = [await drain(j) for j in jobs]
        for events in results:  # no token lost or repeated: the fake shard answers 7 + tokens so far
            assert events[-1][0] == "end" and [e[1].id for e in events[:-1]] == list(range(7, 19))
        assert engine.recovery.restarts == 1 and shards.cleared == 0
        assert engine.healthy and kv.pool.num_free == 64 and not engine.jobs
        loop.cancel()

    asyncio.run(scenario())


def test_alive_shards_that_fail_a_step_fail_only_that_steps_requests():
    async def scenario():
        shards, kv, engine, loop = start(recovery=True)
        first = job(5, 3)
        engine.submit(first)
        shards.broken = True
        assert (await drain(first))[-1][0] == "error"
        assert engine.recovery.restarts == 0 and engine.healthy
        shards.broken = False
        later = job(4, 3)
        engine.submit(later)
        assert (await drain(later))[-1][0] == "end" and kv.pool.num_free == 64
        loop.cancel()

    asyncio.run(scenario())


class BrokenStream(Job):
    """A job whose stream breaks while its last token is delivered (after the scheduler retired it)."""

    def on_token(self, g, piece, last=True):
        raise RuntimeError("the stream broke")


def test_a_bug_after_the_outcome_is_applied_fails_the_requests_it_finished_and_leaks_nothing():
    async def scenario():
        shards, kv, engine, loop = start()
        broken = BrokenStream(Request([1, 2, 3], 1), pb.SamplingParameters(), Detokenizer(Tokenizer(), [], []),
                              frozenset())
        engine.submit(broken)
        assert (await drain(broken))[-1] == ("error", "internal error: RuntimeError('the stream broke')")
        assert not engine.jobs and kv.pool.num_free == 64
        fine = job(3, 2)
        engine.submit(fine)
        assert (await drain(fine))[-1][0] == "end"
        loop.cancel()

    asyncio.run(scenario())
