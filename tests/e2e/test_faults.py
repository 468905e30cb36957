"""Three shards serve what transformers' generate gives; a shard that dies or hangs loses no request: the shard set
is replaced and every stream completes, token for token what generate gives for its prompt alone. One TP=3 server
(SmolLM2: 9 heads, 3 KV heads) lives through both failures."""
import contextlib
import os
import re
import signal
import threading
import time

import httpx
import pytest

from conftest import Server, assert_idle, metric, stream_events
from test_api_errors import post
from test_correctness import prompts
from test_lifecycle import children
from test_speculation_e2e import grounded
from test_tensor_parallel import serve_all

HUNG_WITHIN = 15  # s from a shard's SIGSTOP to /health 503, at the default flags (the promise)
WAIT = 300  # s any wait here gives up after: a bound on a hang, not a timing


@pytest.fixture(scope="module")
def tp3():
    """The deadline flags at their defaults (--shard-timeout 60): a hang is found by the router's Health probes.
    Speculation on: every rank must take a request's cache back to what rank 0 accepted."""
    s = Server("--num-shard", "3", "--max-batch-prefill-tokens", "64", "--max-batch-total-tokens", "8192",
               "--max-total-tokens", "1024", "--speculate", "4")
    yield s
    assert s.stop() == 0, s.logs()


def test_three_shards_match_transformers(tp3, reference):
    all_ids = prompts(reference.tokenizer)[::2]
    assert tp3.info()["num_shard"] == 3
    for ids, ours in zip(all_ids, serve_all(tp3, all_ids, 12)):
        reference.assert_same_greedy(ids, ours, 12)
    ids = grounded(reference.tokenizer)  # alone: it drafts, and rank 0's verdicts rule every rank's cache
    accepted = metric(tp3.url, "cb_speculation_accepted_tokens_total")
    reference.assert_same_greedy(ids, serve_all(tp3, [ids], 32)[0], 32)
    assert metric(tp3.url, "cb_speculation_accepted_tokens_total") > accepted


class Streams:
    """Greedy streams in threads: each prompt's token ids, and any error event it got."""

    def __init__(self, url: str, all_ids: list[list[int]], max_new_tokens: int):
        self.tokens = [[] for _ in all_ids]
        self.errors = []
        self.threads = [threading.Thread(target=self._run, args=(url, i, ids, max_new_tokens))
                        for i, ids in enumerate(all_ids)]
        for t in self.threads:
            t.start()

    def _run(self, url, i, ids, max_new_tokens):
        for event in stream_events(url, ids, max_new_tokens=max_new_tokens):
            if event.get("token"):
                self.tokens[i].append(event["token"]["id"])
            else:
                self.errors.append(event)

    def wait_for_tokens(self, n: int) -> None:
        give_up = time.monotonic() + WAIT
        while sum(map(len, self.tokens)) < n:
            assert time.monotonic() < give_up, f"{sum(map(len, self.tokens))} tokens after {WAIT} s, {self.errors}"
            time.sleep(0.05)

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=WAIT)
        assert not any(t.is_alive() for t in self.threads), f"streams still running after {WAIT} s"


def shard_pid(server: Server, rank: int) -> int:
    return next(pid for pid, cmd in children(server.proc.pid).items() if f"--rank {rank} " in cmd + " ")


def health(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def test_killed_shard_is_replaced_and_every_stream_completes_as_generate(tp3, reference):
    all_ids = prompts(reference.tokenizer)
    all_ids = all_ids[:16] if len(all_ids) >= 16 else (all_ids * 2)[:16]
    restarts = metric(tp3.url, "cb_shard_restarts_total")
    streams = Streams(tp3.url, all_ids, 16)
    constrained = {"inputs": "Some words:", "parameters": {"max_new_tokens": 40, "grammar": {
        "type": "regex", "value": "( [a-z]{1,10}){12}"}}}  # its matcher lives in the router: the restart keeps it
    answers = []
    across = threading.Thread(target=lambda: answers.append(post(tp3.url, constrained, timeout=WAIT).json()))
    across.start()
    streams.wait_for_tokens(40)
    os.kill(shard_pid(tp3, 1), signal.SIGKILL)
    streams.join()
    across.join(timeout=WAIT)
    assert not streams.errors, streams.errors
    for ids, ours in zip(all_ids, streams.tokens):
        reference.assert_same_greedy(ids, ours, 16)
    assert re.fullmatch("( [a-z]{1,10}){12}", answers[0]["generated_text"]), answers
    assert post(tp3.url, constrained, timeout=WAIT).json() == answers[0]  # as without the restart
    assert metric(tp3.url, "cb_shard_restarts_total") == restarts + 1, tp3.logs()
    assert health(tp3.url) == 200
    assert_idle(tp3.url)


def test_stopped_shard_turns_health_503_and_is_replaced(tp3, reference):
    all_ids = prompts(reference.tokenizer)[:4]
    restarts = metric(tp3.url, "cb_shard_restarts_total")
    streams = Streams(tp3.url, all_ids, 24)
    streams.wait_for_tokens(8)
    stopped = shard_pid(tp3, 2)
    os.kill(stopped, signal.SIGSTOP)
    began = time.monotonic()
    try:
        while health(tp3.url) == 200:
            assert time.monotonic() - began < HUNG_WITHIN, f"/health stayed 200 for {HUNG_WITHIN} s"
            time.sleep(0.2)
        streams.join()
    finally:
        with contextlib.suppress(ProcessLookupError):  # the router ends it: this matters only on failure
            os.kill(stopped, signal.SIGCONT)
    assert not streams.errors, streams.errors
    for ids, ours in zip(all_ids, streams.tokens):
        reference.assert_same_greedy(ids, ours, 24)
    assert metric(tp3.url, "cb_shard_restarts_total") == restarts + 1
    assert health(tp3.url) == 200
    assert_idle(tp3.url)
