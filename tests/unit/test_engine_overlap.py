"""The engine streams a step's tokens while the next step computes: the order of that overlap, and that it never
lets a token out past a stop sequence or max_new_tokens. Driven directly with a shard client that records what
each step carried (no model needed: this is the router's own loop)."""
import asyncio

from proto import generate_pb2 as pb
from router.core.kv import KVManager
from router.core.request import Request
from router.core.scheduler import Budget, Scheduler
from router.deadline import Deadline
from router.detokenizer import Detokenizer
from router.engine import Engine
from router.job import Job


class Tokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"<{i}>" for i in ids)


class RecordingShards:
    """Answers each sampled entry with 7 + its tokens so far, after a short "forward"; records every step's
    entries, every filter, and how many tokens each job had streamed when the step began and when it ended."""

    def __init__(self):
        self.deadline = Deadline(60.0)
        self.steps: list[list[tuple[int, bool]]] = []
        self.filters: list[list[int]] = []
        self.streamed: list[tuple[dict, dict]] = []

    async def step(self, step, jobs):
        before = {i: len(j.tokens) for i, j in jobs.items()}
        self.steps.append([(e.request.id, e.sample) for e in step.entries])
        await asyncio.sleep(0.01)
        self.streamed.append((before, {i: len(j.tokens) for i, j in jobs.items()}))
        return pb.StepResponse(generations=[pb.Generation(id=e.request.id, token_id=7 + len(e.request.generated))
                                            for e in step.entries if e.sample])

    async def filter(self, ids):
        self.filters.append((len(self.steps), list(ids)))

    async def health(self):
        pass


def job(n_prompt: int, n_new: int, stop: list[str] = ()) -> Job:
    return Job(Request(list(range(1, n_prompt + 1)), n_new), pb.SamplingParameters(),
               Detokenizer(Tokenizer(), [], list(stop)), frozenset())


async def drain(j: Job) -> list:
    out = []
    while not out or out[-1][0] == "token":
        out.append(await asyncio.wait_for(j.events.get(), 10))
    return out


def start():
    shards, kv = RecordingShards(), KVManager(64, 4)
    engine = Engine(shards, Scheduler(Budget(32, 256, 8, 0.3, 20), kv))
    return shards, kv, engine, asyncio.create_task(engine.run())


def test_a_steps_tokens_stream_while_the_next_step_computes():
    async def scenario():
        shards, kv, engine, loop = start()
        j = job(3, 5)
        engine.submit(j)
        assert (await drain(j))[-1][0] == "end"
        seen = [(before[j.id], after[j.id]) for before, after in shards.streamed if j.id in before]
        assert seen[0] == (0, 0)  # the prefill: nothing to stream yet
        for k, (before, after) in enumerate(seen[1:], start=1):
            assert (before, after) == (k - 1, k), "step k+1 was sent before step k's token streamed"
        loop.cancel()

    asyncio.run(scenario())


def test_a_stop_sequence_found_mid_step_ends_the_request_and_its_token_in_flight_is_dropped():
    async def scenario():
        shards, kv, engine, loop = start()
        stopping, other = job(3, 20, stop=["<9>"]), job(5, 12)
        engine.submit(stopping)
        engine.submit(other)
        events = await drain(stopping)
        tokens = [e[1] for e in events if e[0] == "token"]
        assert [t.id for t in tokens] == [7, 8, 9] and tokens[-1].final
        assert events[-1][1].finish_reason == "stop_sequence"
        sampled = [k for k, entries in enumerate(shards.steps) if (stopping.id, True) in entries]
        assert len(sampled) == 4, "the token after 9 was computed once, in the step in flight, and dropped"
        assert stopping.request.generated == [7, 8, 9]
        assert [e[1].id for e in (await drain(other))[:-1]] == list(range(7, 19))
        filtered = [k for k, ids in shards.filters if stopping.id in ids]
        assert filtered == [sampled[-1] + 1], "the shards forget it before the step after"
        await asyncio.sleep(0.05)
        assert kv.pool.num_free == 64 and not engine.jobs
        loop.cancel()

    asyncio.run(scenario())


def test_max_new_tokens_is_never_exceeded_nor_computed_past():
    async def scenario():
        shards, kv, engine, loop = start()
        jobs = [job(3, n) for n in (1, 2, 4)]
        for j in jobs:
            engine.submit(j)
        for j, n in zip(jobs, (1, 2, 4)):
            events = await drain(j)
            assert [e[1].id for e in events[:-1]] == list(range(7, 7 + n)) and events[-1][1].finish_reason == "length"
            assert sum((j.id, True) in entries for entries in shards.steps) == n
        loop.cancel()

    asyncio.run(scenario())


def test_a_stop_sequence_completed_by_the_last_allowed_token_is_the_finish_reason():
    async def scenario():
        shards, kv, engine, loop = start()
        j = job(3, 3, stop=["<9>"])
        engine.submit(j)
        events = await drain(j)
        assert [e[1].id for e in events[:-1]] == [7, 8, 9] and events[-1][1].finish_reason == "stop_sequence"
        loop.cancel()

    asyncio.run(scenario())
