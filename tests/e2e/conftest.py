"""Shared fixtures: the real model, transformers' own greedy reference, and real launched servers.

Servers are started once per session (model loading dominates on 2 cores); every test that shares one
leaves it as it found it, which `assert_idle` checks through /metrics.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A real `cb-launcher` process tree: shards, router, HTTP on a free port. Nothing is compiled unless the test
    names --compile-sizes (test_compiled_steps.py): a compile costs a 2-core machine 10-45 s of both cores."""

    def __init__(self, *args: str, model_id: str = "smollm2", wait: bool = True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"cb-test-{self.port}.log"
        self.log = open(self.log_path, "w")
        compiled = [] if "--compile-sizes" in args else ["--compile-sizes", "0"]
        cmd = [sys.executable, "-m", "launcher", "--model-id", model_id, "--port", str(self.port),
               "--dtype", "float32", *compiled, *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 600) -> None:
        """Until the router answers /health and the launcher has said `ready` (it polls the router itself; a
        child that dies before then ends the launch, not a served set)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"launcher exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if (httpx.get(f"{self.url}/health", timeout=2).status_code == 200
                        and "[launcher] ready:" in self.log_path.read_text()):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.logs()}")

    def logs(self) -> str:
        return self.log_path.read_text()[-6000:]

    def info(self) -> dict:
        return httpx.get(f"{self.url}/info", timeout=10).json()

    def generate(self, inputs, timeout: float = 600, **parameters) -> dict:
        r = httpx.post(f"{self.url}/generate", json={"inputs": inputs, "parameters": parameters}, timeout=timeout)
        r.raise_for_status()
        return r.json()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def stream_events(url: str, inputs, timeout: float = 600, **parameters):
    """Yields the JSON events of /generate_stream as they arrive."""
    body = {"inputs": inputs, "parameters": parameters}
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=timeout) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                yield json.loads(line[5:])


class Reference:
    """transformers' own greedy `generate`, one prompt alone, fp32: the ground truth."""

    def __init__(self, model_dir: Path):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        torch.manual_seed(0)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

        self._longest: dict[tuple, tuple[int, list[int]]] = {}

    def generate(self, ids, max_new_tokens: int) -> list[int]:
        """Greedy decoding's first n tokens do not depend on how many follow: each prompt is generated once, for
        the most tokens asked of it so far, and every shorter ask is that generation's start."""
        key = tuple(ids)
        if self._longest.get(key, (0,))[0] < max_new_tokens:
            with torch.inference_mode():
                out = self.model.generate(torch.tensor([key]), attention_mask=torch.ones(1, len(key), dtype=torch.long),
                                          max_new_tokens=max_new_tokens, do_sample=False, top_p=None, top_k=None,
                                          temperature=None, pad_token_id=self.tokenizer.eos_token_id)
            self._longest[key] = (max_new_tokens, out[0, len(key):].tolist())
        return self._longest[key][1][:max_new_tokens]

    def logits(self, ids) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(torch.tensor([list(ids)])).logits[0, -1]

    def assert_same_greedy(self, prompt_ids, ours: list[int], max_new_tokens: int) -> None:
        """Token-for-token equality; a divergence is accepted only at a genuine near-tie (|Δlogit| < 1e-3)."""
        ref = self.generate(prompt_ids, max_new_tokens)
        for k, (a, b) in enumerate(zip(ours, ref)):
            if a != b:
                logits = self.logits(list(prompt_ids) + ref[:k])
                gap = abs(float(logits[a] - logits[b]))
                assert gap < 1e-3, f"token {k}: served {a}, transformers {b}, logit gap {gap:.2e} (not a near-tie)"
                return
        assert len(ours) == len(ref), f"served {len(ours)} tokens, transformers {len(ref)}"


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from launcher.model_files import resolve_model
    return resolve_model("smollm2")


@pytest.fixture(scope="session")
def reference(model_dir) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="session")
def tiny_model_dir(model_dir, tmp_path_factory):
    """A 4-layer Llama with 4 heads and 2 KV heads, random weights, SmolLM2's tokenizer: it splits over 2 shards,
    which SmolLM2 (9 heads, 3 KV heads) does not."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(1234)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      initializer_range=0.1, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


HEAD_TIMEOUT, BODY_TIMEOUT = 3, 5  # s: the shared server's, shorter than the defaults so test_slow_clients waits less


@pytest.fixture(scope="session")
def server():
    """One shard, a small prefill budget so longer prompts are chunked, fp32 (the exact mode)."""
    s = Server("--max-batch-prefill-tokens", "64", "--max-batch-total-tokens", "16384",
               "--max-input-tokens", "1024", "--max-total-tokens", "1536",
               "--request-head-timeout", str(HEAD_TIMEOUT), "--request-body-timeout", str(BODY_TIMEOUT))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    """The real `openai` client on the shared server (test_tgi_client.py's own `client` is text-generation's)."""
    import openai
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=300, max_retries=0)
    yield c
    c.close()


def metric(url: str, name: str) -> float:
    """Reads one sample from /metrics with prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)


def assert_idle(url: str, timeout: float = 30) -> None:
    """Every KV block is back in the pool, every swap slot free and nothing offloaded once nothing is running
    (blocks are freed a step later)."""
    deadline = time.monotonic() + timeout
    pairs = [("cb_kv_blocks_free", "cb_kv_blocks_total"), ("cb_swap_blocks_free", "cb_swap_blocks_total")]
    while (any(metric(url, free) != metric(url, total) for free, total in pairs)
           or metric(url, "cb_offloaded_requests") != 0):
        assert time.monotonic() < deadline, "KV blocks or swap slots leaked"
        time.sleep(0.2)
