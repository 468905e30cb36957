"""The launcher's promises: SIGTERM drains (503 for new work while in-flight streams finish; those cut by
--graceful-timeout end with an error event), every process exits 0 and the log says so; once the shard restarts
run out, everything stops with exit 1 and no process is left behind."""
import os
import signal
import threading
import time

import httpx
import psutil

from conftest import Server, stream_events


def children(pid: int) -> dict[int, str]:
    """Direct children of pid: {pid: command line}."""
    out = {}
    for child in psutil.Process(pid).children():
        try:
            out[child.pid] = " ".join(child.cmdline())
        except psutil.ZombieProcess:
            out[child.pid] = ""  # exited, not yet reaped: no command line
        except psutil.Error:
            continue
    return out


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_sigterm_drains_then_exits_0():
    """While draining: 503 JSON for new work and /health; a short stream finishes; a long one is cut at
    --graceful-timeout with an error event; every process exits 0."""
    s = Server("--max-batch-total-tokens", "4096", "--graceful-timeout", "4", "--served-model-name", "story-teller")
    try:
        kids = children(s.proc.pid)
        assert any("-m router" in c for c in kids.values()) and any("-m shard" in c for c in kids.values())
        assert not any("story-teller" in c for c in kids.values()), "settings reach the router in its environment"
        models = httpx.get(f"{s.url}/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == ["story-teller"] == [s.info()["model_id"]]
        long_events = []
        long = threading.Thread(target=lambda: long_events.extend(
            stream_events(s.url, "Count to a thousand.", max_new_tokens=2000, ignore_eos=True)))
        long.start()
        events = []
        for event in stream_events(s.url, "Tell me a long story about a dragon.", max_new_tokens=12,
                                   ignore_eos=True):
            events.append(event)
            if len(events) == 3:
                s.proc.send_signal(signal.SIGTERM)
                assert_draining(s.url)
        long.join(timeout=120)
        assert len(events) == 12, s.logs()
        assert events[-1]["details"]["finish_reason"] == "length"
        assert "error" in long_events[-1] and "graceful" in long_events[-1]["error"], long_events[-1]
        assert s.proc.wait(timeout=120) == 0, s.logs()
        for child in ("router", "shard 0"):
            assert f"[launcher] {child} exited cleanly (code 0)" in s.logs(), s.logs()
        time.sleep(0.5)
        assert not [pid for pid in kids if alive(pid)]
    finally:
        s.stop()


def assert_draining(url: str, timeout: float = 10) -> None:
    """Within `timeout` s of SIGTERM, /health and new requests get 503 JSON (not a refused connection)."""
    give_up = time.monotonic() + timeout
    while (r := httpx.get(f"{url}/health", timeout=5)).status_code == 200:
        assert time.monotonic() < give_up, "/health still 200 after SIGTERM"
        time.sleep(0.1)
    assert r.status_code == 503 and r.json()["error_type"] == "unhealthy" and r.headers["retry-after"]
    new = httpx.post(f"{url}/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}, timeout=10)
    assert new.status_code == 503 and new.json()["error_type"] == "unhealthy"


def test_when_restarts_run_out_the_launcher_exits_1_and_leaves_no_child():
    s = Server("--max-batch-total-tokens", "4096", "--max-restarts", "0")
    try:
        kids = children(s.proc.pid)
        shard = next(pid for pid, cmd in kids.items() if "-m shard" in cmd)
        os.kill(shard, signal.SIGKILL)
        code = s.proc.wait(timeout=120)
        assert code == 1
        assert "shard 0" in s.logs() and "SIGKILL" in s.logs() and "--max-restarts" in s.logs()
        time.sleep(0.5)
        assert not [pid for pid in kids if alive(pid)]
    finally:
        s.stop()
