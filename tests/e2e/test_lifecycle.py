"""The launcher's promises: SIGTERM drains in-flight streams, every process exits 0 and the log says so; a dead
shard takes everything down with a non-zero exit and leaves no process behind."""
import os
import signal
import time
from pathlib import Path

import httpx

from conftest import Server, stream_events


def children(pid: int) -> dict[int, str]:
    """Direct children of pid: {pid: command line}."""
    out = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                out[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_lets_the_stream_finish_then_exits_0():
    s = Server("--max-batch-total-tokens", "4096", "--graceful-timeout", "120", "--served-model-name", "story-teller")
    try:
        kids = children(s.proc.pid)
        assert any("-m router" in c for c in kids.values()) and any("-m shard" in c for c in kids.values())
        assert not any("story-teller" in c for c in kids.values()), "settings reach the router in its environment"
        models = httpx.get(f"{s.url}/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == ["story-teller"] == [s.info()["model_id"]]
        events = []
        for event in stream_events(s.url, "Tell me a long story about a dragon.", max_new_tokens=48,
                                   ignore_eos=True):
            events.append(event)
            if len(events) == 3:
                s.proc.send_signal(signal.SIGTERM)
        assert len(events) == 48, s.logs()
        assert events[-1]["details"]["finish_reason"] == "length"
        assert s.proc.wait(timeout=120) == 0, s.logs()
        for child in ("router", "shard 0"):
            assert f"[launcher] {child} exited cleanly (code 0)" in s.logs(), s.logs()
        time.sleep(0.5)
        assert not [pid for pid in kids if alive(pid)]
    finally:
        s.stop()


def test_killed_shard_fails_the_launcher_and_leaves_no_child():
    s = Server("--max-batch-total-tokens", "4096")
    try:
        kids = children(s.proc.pid)
        shard = next(pid for pid, cmd in kids.items() if "-m shard" in cmd)
        os.kill(shard, signal.SIGKILL)
        code = s.proc.wait(timeout=120)
        assert code != 0
        assert "shard 0" in s.logs() and "SIGKILL" in s.logs()
        time.sleep(0.5)
        assert not [pid for pid in kids if alive(pid)]
    finally:
        s.stop()
