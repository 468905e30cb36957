"""`cb-launcher`: converts the model once, starts the shards, then the router, and supervises them.

Any child dying takes everything down (exit 1): a server missing a shard cannot answer. SIGTERM or
Ctrl-C drains instead: the router finishes in-flight requests first, then the shards stop (exit 0).
"""
import enum
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import typer

from launcher.children import Child, describe_exit, log, stop_all
from launcher.model_files import ModelNotFoundError, resolve_model
from launcher.readiness import router_healthy, router_url, shard_healthy

FAILURE_STOP_TIMEOUT = 5.0  # s between SIGTERM and SIGKILL when tearing down after a failure
SHARD_STOP_TIMEOUT = 10.0   # s the shards get to exit once the router has drained
ROUTER_STOP_MARGIN = 10.0   # s on top of --graceful-timeout before the router is killed

app = typer.Typer(add_completion=False)


class Dtype(str, enum.Enum):
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class Device(str, enum.Enum):
    auto = "auto"  # the shard picks cuda when it is available
    cpu = "cpu"
    cuda = "cuda"


class ChildExited(Exception):
    """A child stopped while nobody asked it to."""


class StopRequested(Exception):
    """SIGTERM or SIGINT reached the launcher."""


class Supervisor:
    """Owns the children. Every wait of the launcher goes through wait_until, so a child dying or a
    stop signal is noticed whatever the launcher is waiting for (a shard loading, or nothing)."""

    def __init__(self):
        self.children: list[Child] = []
        self.stop_signal: Optional[str] = None
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.stop_signal = self.stop_signal or signal.Signals(signum).name

    def spawn(self, name: str, argv: list[str]) -> Child:
        child = Child(name, argv, self.env)
        self.children.append(child)
        return child

    def wait_until(self, ready: Callable[[], bool], waiting_for: Callable[[], str] = lambda: "",
                   interval: float = 0.2, report_every: float = 10.0) -> None:
        start = time.monotonic()
        next_report = start + report_every
        while True:
            if self.stop_signal:
                raise StopRequested
            for child in self.children:
                if (code := child.exit_code()) is not None:
                    raise ChildExited(f"{child.name} {describe_exit(code)}")
            if ready():
                return
            if time.monotonic() >= next_report:
                log("launcher", f"waiting for {waiting_for()}… ({time.monotonic() - start:.0f} s)")
                next_report += report_every
            time.sleep(interval)


def wait_for_shards(supervisor: Supervisor, sockets: list[str]) -> None:
    pending = dict(enumerate(sockets))

    def all_healthy() -> bool:
        for rank, path in list(pending.items()):
            if shard_healthy(path):
                del pending[rank]
                log("launcher", f"shard {rank} is up")
        return not pending

    supervisor.wait_until(all_healthy, lambda: ", ".join(f"shard {rank}" for rank in pending) + " to load")


@app.command()
def main(
    model_id: str = typer.Option("smollm2", envvar="MODEL_ID",
                                 help="smollm2, gemma3-270m, a .gguf file, or a directory with config.json"),
    num_shard: int = typer.Option(1, envvar="NUM_SHARD", help="tensor-parallel shards (processes)"),
    port: int = typer.Option(8080, envvar="PORT"),
    hostname: str = typer.Option("127.0.0.1", envvar="HOSTNAME"),
    max_concurrent_requests: int = typer.Option(128, envvar="MAX_CONCURRENT_REQUESTS"),
    max_input_tokens: int = typer.Option(1024, envvar="MAX_INPUT_TOKENS"),
    max_total_tokens: int = typer.Option(2048, envvar="MAX_TOTAL_TOKENS"),
    max_batch_prefill_tokens: int = typer.Option(512, envvar="MAX_BATCH_PREFILL_TOKENS"),
    max_batch_total_tokens: Optional[int] = typer.Option(
        None, envvar="MAX_BATCH_TOTAL_TOKENS", help="KV cache tokens; default: sized from free memory"),
    max_batch_size: int = typer.Option(64, envvar="MAX_BATCH_SIZE"),
    waiting_served_ratio: float = typer.Option(0.3, envvar="WAITING_SERVED_RATIO"),
    max_waiting_tokens: int = typer.Option(20, envvar="MAX_WAITING_TOKENS"),
    dtype: Dtype = typer.Option(Dtype.bfloat16, envvar="DTYPE"),
    device: Device = typer.Option(Device.auto, envvar="DEVICE"),
    block_size: int = typer.Option(16, envvar="BLOCK_SIZE", help="tokens per KV cache block"),
    max_memory_percent: float = typer.Option(
        0.9, envvar="MAX_MEMORY_PERCENT", help="fraction of free memory the KV cache may take"),
    graceful_timeout: float = typer.Option(
        30.0, envvar="GRACEFUL_TIMEOUT", help="s in-flight requests get to finish on shutdown"),
    master_port: int = typer.Option(29500, envvar="MASTER_PORT", help="torch.distributed rendezvous"),
    uds_dir: Optional[Path] = typer.Option(
        None, envvar="UDS_DIR", help="where the shard sockets go; default: a fresh temp dir"),
):
    """Serves --model-id over HTTP with continuous batching across --num-shard shard processes."""
    try:
        model_dir = resolve_model(model_id)
    except ModelNotFoundError as error:
        log("launcher", f"error: {error}")
        raise typer.Exit(2)
    own_uds_dir = uds_dir is None
    uds_dir = Path(tempfile.mkdtemp(prefix="cb-")) if own_uds_dir else uds_dir
    uds_dir.mkdir(parents=True, exist_ok=True)
    sockets = [str(uds_dir / f"shard-{rank}.sock") for rank in range(num_shard)]

    shard_args = [
        "--model-dir", str(model_dir), "--world-size", str(num_shard), "--master-addr", "127.0.0.1",
        "--master-port", str(master_port), "--dtype", dtype.value, "--device", device.value,
        "--block-size", str(block_size)]
    router_argv = [
        sys.executable, "-m", "router", "--model-dir", str(model_dir), "--uds", ",".join(sockets),
        "--port", str(port), "--hostname", hostname,
        "--max-concurrent-requests", str(max_concurrent_requests), "--max-input-tokens", str(max_input_tokens),
        "--max-total-tokens", str(max_total_tokens), "--max-batch-prefill-tokens", str(max_batch_prefill_tokens),
        *(["--max-batch-total-tokens", str(max_batch_total_tokens)] if max_batch_total_tokens else []),
        "--max-batch-size", str(max_batch_size), "--waiting-served-ratio", str(waiting_served_ratio),
        "--max-waiting-tokens", str(max_waiting_tokens), "--block-size", str(block_size),
        "--max-memory-percent", str(max_memory_percent), "--graceful-timeout", str(graceful_timeout)]

    supervisor = Supervisor()
    router = None
    try:
        log("launcher", f"starting {num_shard} shard(s) from {model_dir} ({dtype.value}, device {device.value})")
        shards = [supervisor.spawn(f"shard {rank}", [sys.executable, "-m", "shard", "--rank", str(rank),
                                                     "--uds", sockets[rank], *shard_args])
                  for rank in range(num_shard)]
        wait_for_shards(supervisor, sockets)
        router = supervisor.spawn("router", router_argv)
        url = router_url(hostname, port)
        supervisor.wait_until(lambda: router_healthy(url), lambda: "the router to warm up the shards")
        log("launcher", f"ready: {url}")
        supervisor.wait_until(lambda: False)
    except ChildExited as error:
        log("launcher", f"{error}: stopping everything")
        code = 1
    except StopRequested:
        log("launcher", f"{supervisor.stop_signal}: shutting down, letting in-flight requests finish")
        if router is not None:
            stop_all([router], graceful_timeout + ROUTER_STOP_MARGIN)
        stop_all(shards, SHARD_STOP_TIMEOUT)
        log("launcher", "stopped")
        code = 0
    finally:  # also reached on a bug in the launcher itself: no child may outlive it
        stop_all(supervisor.children, FAILURE_STOP_TIMEOUT)
        if own_uds_dir:
            shutil.rmtree(uds_dir, ignore_errors=True)
        else:
            for path in sockets:
                Path(path).unlink(missing_ok=True)
    raise typer.Exit(code)
