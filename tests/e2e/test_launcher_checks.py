"""The launcher refuses settings that cannot work before it spawns anything: one line naming the fix, exit 2,
within seconds (not after every shard has loaded, in a traceback)."""
import os
import subprocess
import sys
import time

import pytest

from conftest import REPO
from shard.split_rule import ShardCountError, SplitWidths, check_shard_count


def launch(*args: str, **env: str) -> tuple[int, list[str], float]:
    """Runs the launcher to its end: exit code, output lines, seconds."""
    inherited = {k: v for k, v in os.environ.items() if k != "NUM_SHARD"}
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "launcher", *args], cwd=REPO, capture_output=True, text=True,
                         timeout=60, env={**inherited, "HF_HUB_OFFLINE": "1", **env})
    return out.returncode, (out.stdout + out.stderr).splitlines(), time.monotonic() - start


def test_the_split_rule_names_every_shard_count_that_works():
    smollm2 = SplitWidths.of({"num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536})
    assert smollm2.shard_counts() == [1, 3]  # 9 splits the heads but not the MLP (1536 = 2^9 x 3)
    gemma = SplitWidths.of({"text_config": {"num_attention_heads": 4, "num_key_value_heads": 1,
                                            "intermediate_size": 2048}})
    assert gemma.shard_counts() == [1, 2, 4]  # the one KV head is replicated
    with pytest.raises(ShardCountError, match=r"--num-shard 2 cannot split m \(.*\): use 1 or 3$"):
        check_shard_count(smollm2, 2, "m")


def test_a_shard_count_that_cannot_split_the_model_fails_at_once(model_dir):
    code, lines, seconds = launch("--model-id", "smollm2", "--num-shard", "2")
    assert code == 2, lines
    assert lines == ["[launcher] error: --num-shard 2 cannot split smollm2 (9 attention heads, 3 KV heads, "
                     "MLP width 1536): use 1 or 3"]
    assert seconds < 15
