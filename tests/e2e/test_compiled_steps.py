"""The compiled path as served: /info names the step sizes compiled at start-up (`--compile-sizes auto`: 1 to 32
tokens), /metrics counts the steps that ran them and those that ran eagerly, and a request whose steps
take both gives transformers' greedy tokens (test_correctness holds the rest of the golden tests, on the same
server)."""
import httpx
from prometheus_client.parser import text_string_to_metric_families

from shard import compile_sizes
from test_correctness import LONG_SEED


def forward_steps(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {sample.labels["path"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == "cb_forward_steps_total"}


def test_steps_beyond_every_compiled_size_run_eagerly_and_agree(server, reference):
    info = server.info()
    device = info["model_device_type"].split(":")[0]
    assert info["compiled_step_sizes"] == list(compile_sizes.AUTO[device])
    assert info["compile_seconds"] > 0
    # chunks of 64 and 36 tokens, eager steps; its own first words, so no other test's prompt is a cached prefix
    ids = reference.tokenizer("Steps beyond every compiled size. " + LONG_SEED[0] * 8)["input_ids"][:100]
    before = forward_steps(server.url)
    out = server.generate(ids, max_new_tokens=8, details=True)
    after = forward_steps(server.url)
    assert after.get("eager", 0) - before.get("eager", 0) >= 2, (before, after)
    assert after["compiled"] - before.get("compiled", 0) >= 7, (before, after)  # one decode a step
    reference.assert_same_greedy(ids, [t["id"] for t in out["details"]["tokens"]], 8)
