"""The launcher's child processes: started so they cannot outlive it, their output relayed under a name."""
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)  # looked up before fork: the child should do little
_print_lock = threading.Lock()


def log(name: str, message: str) -> None:
    """One line on stderr, prefixed with who said it; relay threads and the launcher share the lock."""
    with _print_lock:
        sys.stderr.write(f"[{name}] {message}\n")
        sys.stderr.flush()


def _die_with_parent(parent_pid: int):
    """Runs in the child between fork and exec: SIGTERM it when the launcher dies, even by SIGKILL."""
    def preexec() -> None:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:  # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)
    return preexec


def describe_exit(code: int) -> str:
    if code == 0:
        return "exited cleanly (code 0)"
    if code < 0:
        return f"exited with code {code} (killed by {signal.Signals(-code).name})"
    return f"exited with code {code}"


class Child:
    """A child process in its own session, so a terminal's Ctrl-C reaches only the launcher.

    PR_SET_PDEATHSIG fires when the thread that forked exits, so children must be spawned from the
    main thread, which lives as long as the launcher does.
    """

    def __init__(self, name: str, argv: list[str], env: dict[str, str]):
        self.name = name
        self.proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_die_with_parent(os.getpid()))
        self.relay = threading.Thread(target=self._relay, name=f"relay {name}", daemon=True)
        self.relay.start()

    def _relay(self) -> None:
        for line in self.proc.stdout:
            log(self.name, line.decode(errors="replace").rstrip("\n"))

    def exit_code(self):
        return self.proc.poll()

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)


def stop_all(children: list[Child], timeout: float) -> None:
    """SIGTERM whichever are running, SIGKILL any still there after `timeout` s, and reap them all.

    Each child leads its own process group, so what it started itself (compile workers…) goes too.
    """
    running = [child for child in children if child.exit_code() is None]
    for child in running:
        child.terminate()
    deadline = time.monotonic() + timeout
    for child in running:
        try:
            child.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log("launcher", f"{child.name} still running {timeout:.0f} s after SIGTERM: sending SIGKILL")
            child.proc.kill()
            child.proc.wait()
        log("launcher", f"{child.name} {describe_exit(child.proc.returncode)}")
    for child in children:
        try:
            os.killpg(child.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.relay.join(timeout=1.0)
