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

from launcher import nodes
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


def shard_argv(settings: Settings, model_dir: Path, rank: int, socket: str, rendezvous: str) -> list[str]:
    """`rendezvous`: the file torch.distributed's ranks meet through, beside the sockets, so no port is opened
    for it; across nodes, node 0's store (nodes.py)."""
    quantize = as_flags(quantize=settings.quantize) if settings.quantize else []
    return [sys.executable, "-m", "shard", *as_flags(
        model_dir=model_dir, rank=rank, world_size=settings.num_shard,
        local_world_size=settings.num_shard // settings.nnodes, uds=socket, rendezvous=rendezvous,
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
    if settings.node_rank > 0:
        raise typer.Exit(other_node(settings, model_dir))
    own_uds_dir = settings.uds_dir is None
    uds_dir = Path(tempfile.mkdtemp(prefix="cb-")) if own_uds_dir else Path(settings.uds_dir)
    uds_dir.mkdir(parents=True, exist_ok=True)
    local = nodes.ranks(settings)
    sockets = [str(uds_dir / f"shard-{rank}.sock") for rank in local]
    rendezvous = uds_dir / "rendezvous"
    remote = None
    if settings.nnodes > 1:
        remote = nodes.Remote(settings)
        try:
            remote.host()
        except Exception as error:  # the port taken, the address not this machine's
            log("launcher", f"error: cannot open the store at {nodes.store_url(settings)}: {error}")
            raise typer.Exit(2) from None
    meet = nodes.store_url(settings) if remote else str(rendezvous)
    shard_argvs = [shard_argv(settings, model_dir, rank, sockets[i], meet) for i, rank in enumerate(local)]
    log("launcher", f"starting {len(local)} shard(s) from {model_dir} ({settings.dtype}, device {settings.device})"
        + (f", node 0 of {settings.nnodes} ({settings.num_shard} shards in all)" if remote else ""))
    try:
        code = Supervisor({ENV: settings.to_json()}, STARTED).run(
            shard_argvs, sockets,
            lambda addresses: [sys.executable, "-m", "router", *as_flags(model_dir=model_dir, uds=",".join(addresses))],
            router_url(settings.hostname, settings.port), settings.graceful_timeout, settings.max_restarts,
            before_shards=lambda: rendezvous.unlink(missing_ok=True),  # an old set's store would mislead a new one
            remote=remote)
    finally:
        if own_uds_dir:
            shutil.rmtree(uds_dir, ignore_errors=True)
        else:
            for path in [*sockets, rendezvous]:
                Path(path).unlink(missing_ok=True)
    raise typer.Exit(code)


def other_node(settings: Settings, model_dir: Path) -> int:
    """A node other than 0 runs its ranks only: they serve gRPC on the interface that reaches node 0's store."""
    local = nodes.ranks(settings)
    log("launcher", f"starting shards {local.start}-{local.stop - 1} of {settings.num_shard} from {model_dir}, node "
                    f"{settings.node_rank} of {settings.nnodes}, meeting at {nodes.store_url(settings)}")
    argvs = [shard_argv(settings, model_dir, rank, "tcp", nodes.store_url(settings)) for rank in local]
    return Supervisor({ENV: settings.to_json()}, STARTED).run_ranks(argvs, local.start)
