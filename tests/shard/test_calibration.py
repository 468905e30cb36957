"""Warmup's timed steps (shard/calibration.py) on a tiny random Llama: every step of the plan runs, on a scratch
pool, leaving the serving runner's requests and pools as they were."""
import torch

from shard import calibration
from shard import model as model_lib
from shard.runner import Runner


def test_every_planned_step_is_timed_on_a_scratch_pool(tiny_llama):
    r = Runner(model_lib.load(str(tiny_llama), "float32", torch.device("cpu"), 0, 1), torch.device("cpu"), 4, 0, 1)
    r.allocate(8)
    pool = r.cache.full
    timed = calibration.time_steps(r, max_prefill_tokens=48, max_batch_size=20)
    assert [t[:3] for t in timed] == calibration.plan(48, 20) == [
        (1, 0, 0), (16, 0, 0), (20, 0, 0), (16, 0, 48), (16, 48, 48)]
    assert all(seconds > 0 for *_, seconds in timed)
    assert r.cache.full is pool and not r.requests
