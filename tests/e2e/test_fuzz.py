"""A bounded fuzz of every POST route, generated from the server's own /openapi.json: a few hundred bodies (fixed
seed) mixing plausible values with boundary integers, non-finite floats sent as raw JSON tokens, wrong types,
nulls, long strings and missing required fields. Whatever arrives, nothing answers 5xx, every answer is strict JSON
(or SSE of strict JSON, with no error event), every refusal is in its route's shape, and the server ends idle.

Hand-written (neither hypothesis nor schemathesis is a dependency); max_new_tokens/max_tokens stay small where
they are valid so the run takes well under a minute on 2 cores.
"""
import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import assert_idle
from test_api_errors import HUGE, INF, NAN, NEG_INF, Raw, post, strict_json

SEED = 1234
BODIES_PER_ROUTE = 60
TOKEN_FIELDS = {"max_new_tokens", "max_tokens", "max_completion_tokens"}
INTS = [-1, 0, 1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, -2**63 - 1]
FLOATS = [NAN, INF, NEG_INF, Raw("-0.0"), Raw("1e-38"), Raw("1e308"), HUGE, Raw("1e-400"), Raw("5e-324")]
WRONG = ["", "NaN", "1", [], {}, True, None, [None], {"a": [1]}]
TEXTS = ["hello", "The capital of France is", "€ ü 日本\u0000", "\n\n", "x" * 1000, "<|im_start|>", "lone \ud800"]
NUMBERS = {"temperature": [0, 1e-38, 1e-5, 0.7, 1.0, 1e308], "top_p": [1e-45, 0.5, 0.9, 1.0],
           "typical_p": [1e-45, 0.5, 1.0], "repetition_penalty": [1e-38, 0.5, 1.2, 1e308],
           "frequency_penalty": [-2, 0, 2], "presence_penalty": [0]}
INTEGERS = {"top_k": [1, 5, 50, 49152, 2**40, -1, 0], "top_n_tokens": [0, 1, 5], "logprobs": [0, 1, 5],
            "top_logprobs": [0, 2, 5], "seed": [0, 1, 2**64 - 1], "truncate": [1, 8, 50], "priority": [-3, 0, 3],
            "n": [1], "best_of": [1]}


class Fuzzer:
    """Values for a JSON schema: plausible ones (so requests reach the shards), each hostile with probability
    `rate`."""

    def __init__(self, spec: dict, rng: random.Random):
        self.schemas = spec["components"]["schemas"]
        self.rng = rng
        self.rate = 0.25

    def resolve(self, schema: dict) -> dict:
        while "$ref" in schema:
            schema = self.schemas[schema["$ref"].rsplit("/", 1)[1]]
        return schema

    def value(self, schema: dict, name: str = "", depth: int = 0):
        if self.rng.random() < self.rate or depth > 4:
            return self.hostile()
        return self.plausible(self.resolve(schema), name, depth)

    def hostile(self):
        pick = self.rng.random()
        if pick < 0.01:
            return "y" * self.rng.choice([100_000, 1_500_000])  # under --payload-limit (2 MB)
        return self.rng.choice(INTS if pick < 0.35 else FLOATS if pick < 0.7 else WRONG)

    def plausible(self, schema: dict, name: str, depth: int):
        rng = self.rng
        if "anyOf" in schema:
            return self.value(rng.choice(schema["anyOf"]), name, depth + 1)
        kind = schema.get("type")
        if kind == "object":
            return self.obj(schema, depth)
        if kind == "array":
            return [self.value(schema.get("items", {}), name, depth + 1) for _ in range(rng.randint(0, 3))]
        if kind == "integer":
            small = rng.randint(1, 4) if name in TOKEN_FIELDS else rng.randint(0, 999)
            return rng.choice(INTEGERS.get(name, [small]))
        if kind == "number":
            return rng.choice(NUMBERS.get(name, [0.0, 0.5, 1.0]))
        if kind == "boolean":
            return name != "watermark" and rng.random() < 0.5  # a watermark is always refused
        if kind == "string":
            return rng.choice(["user", "system", "assistant"]) if name == "role" else rng.choice(TEXTS)
        if kind == "null":
            return None
        return rng.choice([{"type": "text", "text": "hi"}, "hi", 1, None])  # any value

    def obj(self, schema: dict, depth: int) -> dict:
        out, required = {}, set(schema.get("required", ()))
        for name, sub in schema.get("properties", {}).items():
            keep = 0.9 if name in required else 1.0 if name in TOKEN_FIELDS or name == "parameters" else 0.4
            if self.rng.random() < keep:
                out[name] = self.value(sub, name, depth + 1)
        if isinstance(schema.get("additionalProperties"), dict):
            out.update({str(self.rng.randint(0, 9)): self.value(schema["additionalProperties"], "", depth + 1)})
        if self.rng.random() < 0.1:
            out["an_unknown_field"] = self.hostile()
        return out


def bounded(path: str, body):
    """Where the body would generate, at most a few tokens (an absent max_new_tokens runs to --max-total-tokens)."""
    if not isinstance(body, dict):
        return body
    if path.startswith("/v1/"):
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = 4
    elif isinstance(body.get("parameters", {}), dict):
        body["parameters"] = {**body.get("parameters", {})}
        if body["parameters"].get("max_new_tokens") is None:
            body["parameters"]["max_new_tokens"] = 4
    return body


def check(path: str, r: httpx.Response) -> str:
    """Asserts the answer's form; returns its status for the summary."""
    assert r.status_code < 500, f"{path}: {r.status_code} {r.text[:300]}"
    if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
        events = [line.split(":", 1)[1].strip() for line in r.text.splitlines() if line.startswith("data:")]
        assert events and all("error" not in strict_json(e) for e in events if e != "[DONE]"), r.text[:300]
        return "200 stream"
    body = strict_json(r.text)
    if r.status_code >= 400:
        if path.startswith("/v1/"):
            assert set(body["error"]) == {"message", "type", "param", "code"}, body
        else:
            assert set(body) == {"error", "error_type"}, body
    return str(r.status_code)


def cases(spec: dict) -> list[tuple[str, object]]:
    rng, fuzz, out = random.Random(SEED), Fuzzer(spec, random.Random(SEED + 1)), []
    for path, ops in sorted(spec["paths"].items()):
        if "post" not in ops:
            continue
        schema = ops["post"]["requestBody"]["content"]["application/json"]["schema"]
        for _ in range(BODIES_PER_ROUTE):
            fuzz.rate = rng.choice([0.0, 0.05, 0.25])
            body = fuzz.value(schema) if rng.random() < 0.1 else fuzz.plausible(fuzz.resolve(schema), "", 0)
            out.append((path, bounded(path, body)))
    return out


@pytest.mark.timeout(300)
def test_schema_fuzz_never_5xx(server):
    spec = httpx.get(server.url + "/openapi.json", timeout=30).json()
    bodies = cases(spec)
    assert {p for p, _ in bodies} >= {"/generate", "/generate_stream", "/", "/tokenize", "/v1/completions",
                                      "/v1/chat/completions"}
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda case: (case[0], check(case[0], post(server.url, case[1], case[0]))),
                                 bodies))
    summary = Counter(statuses)
    generated = sum(n for (_, status), n in summary.items() if status.startswith("200"))
    assert generated >= len(bodies) // 10, summary  # enough bodies were valid to reach the shards
    assert_idle(server.url)
