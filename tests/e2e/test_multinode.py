"""Tensor parallelism across nodes, on loopback: two launchers (`--nnodes 2`, one rank each) meet at node 0's store.
The set serves transformers' greedy tokens, and when a node's part of it goes, every launcher exits 1 with one
clear message (never a hang): a rank killed on node 1, then node 0 stopped under node 1's running rank.
"""
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import REPO, Reference, Server, free_port
from test_correctness import SHORT, prompts
from test_tensor_parallel import serve_all

EXIT_WITHIN = 30.0  # s: node 0 probes its remote ranks every 2 s (2 strikes); a remote rank looks at the store every 1 s


def node_args(model: Path, port: int) -> list[str]:
    return ["--nnodes", "2", "--num-shard", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
            "--max-batch-prefill-tokens", "64", "--max-batch-total-tokens", "4096", "--max-total-tokens", "1024"]


class OtherNode:
    """A launcher with --node-rank 1: its rank only, no HTTP."""

    def __init__(self, model: Path, port: int, tmp_path: Path):
        self.log_path = tmp_path / "node1.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "launcher", "--model-id", str(model), "--dtype", "float32",
                                      "--compile-sizes", "0", "--node-rank", "1", *node_args(model, port)],
                                     cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)

    def shard(self) -> psutil.Process:
        return next(p for p in psutil.Process(self.proc.pid).children() if "shard" in " ".join(p.cmdline()))

    def wait(self) -> int:
        try:
            return self.proc.wait(EXIT_WITHIN)
        finally:
            self.log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def node_zero(model: Path, port: int) -> Server:
    return Server("--node-rank", "0", *node_args(model, port), model_id=str(model))


def exit_code(server: Server) -> int:
    server.proc.wait(EXIT_WITHIN)
    server.log.close()
    return server.proc.returncode


@pytest.fixture
def nodes(tiny_model_dir, tmp_path):
    port = free_port()
    other = OtherNode(tiny_model_dir, port, tmp_path)
    try:
        zero = node_zero(tiny_model_dir, port)
    except Exception:
        other.kill()
        raise
    yield zero, other
    zero.stop()
    other.kill()


def test_two_nodes_serve_transformers_tokens_and_a_rank_lost_on_node_1_ends_both(nodes, tiny_model_dir):
    zero, other = nodes
    assert zero.info()["num_shard"] == 2
    ref = Reference(tiny_model_dir)
    all_ids = [ref.tokenizer(p)["input_ids"] for p in SHORT] + prompts(ref.tokenizer)[10:12]
    for ids, ours in zip(all_ids, serve_all(zero, all_ids, 16)):
        ref.assert_same_greedy(ids, ours, 16)

    other.shard().kill()  # SIGKILL: the rank on node 1 is gone mid-service
    assert exit_code(zero) == 1, zero.logs()
    assert other.wait() == 1, other.log_path.read_text()
    said = zero.log_path.read_text()
    assert "rank 1 at 127.0.0.1:" in said and "stopped answering" in said, said[-3000:]
    assert "a set across nodes is not replaced" in said


def test_node_0_stopping_ends_node_1(nodes):
    zero, other = nodes
    assert zero.generate("Hello", max_new_tokens=4)["generated_text"] is not None
    started = time.monotonic()
    zero.proc.send_signal(signal.SIGTERM)  # a drain on node 0: its store goes with its launcher
    assert exit_code(zero) == 0, zero.logs()
    assert other.wait() == 1, other.log_path.read_text()
    said = other.log_path.read_text()
    assert "node 0's store at tcp://127.0.0.1:" in said and "stopped answering" in said, said[-3000:]
    assert time.monotonic() - started < EXIT_WITHIN
