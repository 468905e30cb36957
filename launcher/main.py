"""`cb-launcher`: converts the model once, starts the shards and then the router, and supervises them.

Its options are router/settings.py's declaration (one flag, env var and default each); the router receives the
settled values as JSON in its environment, the shards the few they need as arguments.
"""
import shutil
import sys
import tempfile
import time
from pathlib import Path

import typer

from launcher.checks import LaunchError, check_launch
from launcher.children import log
from launcher.model_files import ModelNotFoundError, resolve_model
from launcher.readiness import router_url
from launcher.supervisor import Supervisor
from router.settings import ENV, Settings, settings_command

app = typer.Typer(add_completion=False, rich_markup_mode=None)
STARTED = time.monotonic()  # start-up's phases are logged counting from here


def as_flags(**flags) -> list[str]:
    """`--flag value` pairs in the children's CLI spelling."""
    return [arg for name, value in flags.items() for arg in (f"--{name.replace('_', '-')}", str(value))]


def shard_argv(settings: Settings, model_dir: Path, rank: int, socket: str, rendezvous: Path) -> list[str]:
    """`rendezvous`: the file torch.distributed's ranks meet through, beside the sockets, so no port is opened
    for it."""
    quantize = as_flags(quantize=settings.quantize) if settings.quantize else []
    return [sys.executable, "-m", "shard", *as_flags(
        model_dir=model_dir, rank=rank, world_size=settings.num_shard, uds=socket, rendezvous=rendezvous,
        dtype=settings.dtype, device=settings.device, block_size=settings.block_size,
        compile_sizes=settings.compile_sizes), *quantize]


@app.command()
@settings_command()
def main(settings: Settings):
    """Serves --model-id over HTTP with continuous batching across --num-shard shard processes."""
    try:
        model_dir = resolve_model(settings.model_id)
        check_launch(settings, model_dir)
    except (ModelNotFoundError, LaunchError) as error:
        log("launcher", f"error: {error}")
        raise typer.Exit(2) from None
    own_uds_dir = settings.uds_dir is None
    uds_dir = Path(tempfile.mkdtemp(prefix="cb-")) if own_uds_dir else Path(settings.uds_dir)
    uds_dir.mkdir(parents=True, exist_ok=True)
    sockets = [str(uds_dir / f"shard-{rank}.sock") for rank in range(settings.num_shard)]
    rendezvous = uds_dir / "rendezvous"
    shard_argvs = [shard_argv(settings, model_dir, rank, sockets[rank], rendezvous)
                   for rank in range(settings.num_shard)]
    router_argv = [sys.executable, "-m", "router", *as_flags(model_dir=model_dir, uds=",".join(sockets))]
    log("launcher", f"starting {settings.num_shard} shard(s) from {model_dir} ({settings.dtype}, "
                    f"device {settings.device})")
    try:
        code = Supervisor({ENV: settings.to_json()}, STARTED).run(
            shard_argvs, sockets, router_argv, router_url(settings.hostname, settings.port),
            settings.graceful_timeout, settings.max_restarts,
            before_shards=lambda: rendezvous.unlink(missing_ok=True))  # an old set's store would mislead a new one
    finally:
        if own_uds_dir:
            shutil.rmtree(uds_dir, ignore_errors=True)
        else:
            for path in [*sockets, rendezvous]:
                Path(path).unlink(missing_ok=True)
    raise typer.Exit(code)
