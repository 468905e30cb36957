"""Starting and stopping a cb server for `cb-bench --launch`."""
from __future__ import annotations

import shlex
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(port: int, dtype: str, extra: list[str], url: str, log_path=None) -> subprocess.Popen:
    """Start `python -m launcher` and block until /health answers 200 (or the process dies). The server's own log
    goes to `log_path` when given."""
    cmd = [sys.executable, "-m", "launcher", "--port", str(port), "--dtype", dtype, *extra]
    print(f"launching: {shlex.join(cmd)}" + (f"  (log: {log_path})" if log_path else ""), file=sys.stderr)
    out = open(log_path, "w") if log_path else None
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"launcher exited with code {proc.returncode} before becoming healthy")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    stop_server(proc)
    raise RuntimeError("server not healthy after 300 s")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
