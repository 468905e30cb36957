"""The launcher refuses settings that cannot work before it spawns anything: one line naming the fix, exit 2
(not after every shard has loaded, in a traceback: a spawned shard or router would add its own lines)."""
import os
import subprocess
import sys

import httpx
import pytest

from conftest import REPO, Server
from shard.split_rule import ShardCountError, SplitWidths, check_shard_count


def launch(*args: str, **env: str) -> tuple[int, list[str]]:
    """Runs the launcher to its end: exit code, output lines."""
    inherited = {k: v for k, v in os.environ.items() if k not in ("API_KEY", "API_KEY_FILE", "NUM_SHARD")}
    out = subprocess.run([sys.executable, "-m", "launcher", *args], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={**inherited, "HF_HUB_OFFLINE": "1", **env})
    return out.returncode, (out.stdout + out.stderr).splitlines()


def test_the_split_rule_names_every_shard_count_that_works():
    smollm2 = SplitWidths.of({"num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536})
    assert smollm2.shard_counts() == [1, 3]  # 9 splits the heads but not the MLP (1536 = 2^9 x 3)
    gemma = SplitWidths.of({"text_config": {"num_attention_heads": 4, "num_key_value_heads": 1,
                                            "intermediate_size": 2048}})
    assert gemma.shard_counts() == [1, 2, 4]  # the one KV head is replicated
    with pytest.raises(ShardCountError, match=r"--num-shard 2 cannot split m \(.*\): use 1 or 3$"):
        check_shard_count(smollm2, 2, "m")


def test_a_shard_count_that_cannot_split_the_model_fails_at_once(model_dir):
    code, lines = launch("--model-id", "smollm2", "--num-shard", "2")
    assert code == 2, lines
    assert lines == ["[launcher] error: --num-shard 2 cannot split smollm2 (9 attention heads, 3 KV heads, "
                     "MLP width 1536): use 1 or 3"]


def test_compile_sizes_that_are_not_a_list_of_sizes_fail_at_once(model_dir):
    for sizes in ("1,two", "-8"):
        code, lines = launch("--compile-sizes", sizes)
        assert code == 2 and len(lines) == 1 and "--compile-sizes" in lines[0], (sizes, lines)


def test_an_api_key_file_that_cannot_be_used_fails_at_once(model_dir, tmp_path):
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    (tmp_path / "empty").write_text(" \n")
    refused = {("--api-key-file", str(tmp_path / "missing")): "cannot read it",
               ("--api-key-file", str(tmp_path / "empty")): "is empty",
               ("--api-key", "other", "--api-key-file", str(key)): "both given"}
    for args, reason in refused.items():
        code, lines = launch(*args)
        assert code == 2 and len(lines) == 1 and reason in lines[0], (args, lines)
    code, lines = launch("--api-key-file", str(key), API_KEY="other")
    assert code == 2 and "both given" in lines[0], lines


def test_the_router_guards_every_route_with_the_key_from_the_file(tmp_path):
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    s = Server("--max-batch-total-tokens", "2048", "--max-total-tokens", "1024", "--api-key-file", str(key))
    try:
        body = {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}
        assert httpx.post(s.url + "/generate", json=body, timeout=60).status_code == 401
        ok = httpx.post(s.url + "/generate", json=body, headers={"Authorization": "Bearer s3cret"}, timeout=60)
        assert ok.status_code == 200, ok.text
        assert not any("s3cret" in arg for arg in s.proc.args)
    finally:
        assert s.stop() == 0
