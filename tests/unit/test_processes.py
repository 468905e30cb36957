"""What the project reads about processes and memory, through psutil: the router ends only the old shard set's
processes (their command line names one of its sockets), the soak finds a server's processes by role with their
RSS, and a CPU shard's pools are sized from the memory the kernel says is available."""
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from bench.soak import rss_mb, server_tree
from router.recovery import end_processes
from shard.kv_cache import free_memory

SLEEP = "import time; time.sleep(60)"


def sleeper(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SLEEP, *args])


def test_end_processes_kills_only_those_naming_a_socket():
    gone = sleeper()
    gone.kill()
    gone.wait()
    ours, other = sleeper("--uds", "/run/cb-1/shard-0.sock"), sleeper("--uds", "/run/cb-2/shard-0.sock")
    try:
        end_processes([gone.pid, ours.pid, other.pid], ["/run/cb-1/shard-0.sock"])
        assert ours.wait(10) == -9
        time.sleep(0.2)
        assert other.poll() is None
    finally:
        for proc in (ours, other):
            proc.kill()
            proc.wait()


def test_server_tree_by_role_with_rss():
    spawn = (f"import subprocess, sys, time\nfor args in (['router'], ['shard', '--rank', '1']):\n"
             f"    subprocess.Popen([sys.executable, '-c', {SLEEP!r}, *args])\ntime.sleep(60)")
    launcher = subprocess.Popen([sys.executable, "-c", spawn])
    try:
        deadline = time.monotonic() + 20
        while len(tree := server_tree(launcher.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sorted(tree) == ["launcher", "router", "shard 1"] and tree["launcher"] == launcher.pid
        assert all(rss_mb(pid) > 1 for pid in tree.values())
    finally:
        for proc in psutil.Process(launcher.pid).children(recursive=True) + [psutil.Process(launcher.pid)]:
            proc.kill()
        launcher.wait()


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="Linux's /proc/meminfo to compare with")
def test_cpu_free_memory_is_a_share_of_memavailable():
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    available = int(info["MemAvailable"].split()[0]) * 1024
    assert free_memory(torch.device("cpu"), 2) == pytest.approx(available // 2, rel=0.05)
