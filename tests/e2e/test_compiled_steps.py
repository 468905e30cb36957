"""The compiled path as served (`--compile-sizes 2,4,8`: the symbolic graph alone, the larger compile of the two;
tests/shard/test_compiled.py covers size 1 and `auto`). A CPU shard serves at once,
eagerly, while it compiles in the background: requests answered meanwhile give transformers' greedy tokens; /info
says `compiling`, then `ready` with the step sizes; /metrics counts the steps that ran compiled and those that ran
eagerly, and a request whose steps take both gives transformers' greedy tokens too."""
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import Server
from test_correctness import LONG_SEED, prompts

SIZES = (2, 4, 8)
COMPILE_TIMEOUT = 600  # s: a cold compile on a loaded 2-core machine takes up to a minute; this only bounds a hang


@pytest.fixture(scope="module")
def compiling():
    s = Server("--compile-sizes", ",".join(map(str, SIZES)), "--max-batch-prefill-tokens", "64",
               "--max-batch-total-tokens", "8192", "--max-total-tokens", "1024")
    yield s
    assert s.stop() == 0, s.logs()


def forward_steps(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {sample.labels["path"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == "cb_forward_steps_total"}


def wait_until_compiled(server: Server) -> dict:
    give_up = time.monotonic() + COMPILE_TIMEOUT
    while (info := server.info())["compile_state"] == "compiling":
        assert time.monotonic() < give_up, f"still compiling after {COMPILE_TIMEOUT} s:\n{server.logs()}"
        time.sleep(0.5)
    return info


def test_requests_served_while_compiling_equal_generate(reference, compiling):
    """Runs first: the server is ready before its compile is done, so these steps run eagerly beside it."""
    if compiling.info()["compile_state"] != "compiling":
        pytest.skip("the compile was over before the first request (a cache this fast makes the test moot)")
    all_ids = prompts(reference.tokenizer)[:8]
    with ThreadPoolExecutor(len(all_ids)) as pool:
        answers = list(pool.map(lambda ids: compiling.generate(ids, max_new_tokens=12, details=True), all_ids))
    steps = forward_steps(compiling.url)
    state = compiling.info()["compile_state"]
    for ids, answer in zip(all_ids, answers):
        reference.assert_same_greedy(ids, [t["id"] for t in answer["details"]["tokens"]], 12)
    if state == "compiling":  # else the compile ended mid-way: the tokens are still checked above
        assert steps.get("compiled", 0) == 0 and steps["eager"] > 0, steps


def test_steps_beyond_every_compiled_size_run_eagerly_and_agree(compiling, reference):
    info = wait_until_compiled(compiling)
    assert info["compile_state"] == "ready", compiling.logs()
    assert info["compiled_step_sizes"] == list(SIZES)
    assert info["compile_seconds"] > 0
    # chunks of 64 and 36 tokens, eager steps; their own first words, so no other test's prompt is a cached prefix;
    # a step of one decode is below every size here (eager), of both decodes it runs the graph
    ids = [reference.tokenizer(f"Steps beyond every compiled size, {k}. " + LONG_SEED[0] * 8)["input_ids"][:100]
           for k in range(2)]
    before = forward_steps(compiling.url)
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda i: compiling.generate(i, max_new_tokens=8, details=True), ids))
    after = forward_steps(compiling.url)
    assert after.get("eager", 0) - before.get("eager", 0) >= 2, (before, after)
    assert after.get("compiled", 0) - before.get("compiled", 0) >= 1, (before, after)  # 3-5: as their steps overlap
    for i, out in zip(ids, outs):
        reference.assert_same_greedy(i, [t["id"] for t in out["details"]["tokens"]], 8)
