"""`python -m shard`: load this rank's slice of the model and serve the Shard service on a unix socket.

Started by the launcher, which passes every option (their defaults live with the other settings, in
router/settings.py)."""
import gc
import logging
import os
import signal
import threading
from typing import Optional

import typer

from shard import compile_sizes as sizes
from shard.cpu import cache_dir

app = typer.Typer(add_completion=False, rich_markup_mode=None)


@app.command()
def main(
    model_dir: str = typer.Option(...),
    uds: str = typer.Option(..., help="unix socket path to serve on, or tcp: a port on the interface that reaches "
                                      "the store (a rank on a node other than 0; published in the store)"),
    rank: int = typer.Option(...),
    world_size: int = typer.Option(...),
    local_world_size: int = typer.Option(0, help="ranks on this machine (default: all of them)"),
    rendezvous: str = typer.Option(..., help="file the ranks meet through (torch.distributed's FileStore), or "
                                             "node 0's store as tcp://host:port (rendezvous.py)"),
    dtype: str = typer.Option(...),
    device: str = typer.Option(...),
    block_size: int = typer.Option(...),
    quantize: Optional[str] = typer.Option(None),
    compile_sizes: str = typer.Option(..., help="step sizes compiled at warmup (compile_sizes.py)"),
):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # kept across reboots, unlike /tmp; one folder per largest size: a graph cached for steps of 2..32 tokens, found
    # again while compiling 2..64, brings its guard (at most 32) along, and that compile fails
    # (set before torch._inductor is imported, which fills in its own default; `auto` is up to 32 on any device)
    largest = max(sizes.parse(compile_sizes, "cuda" if device == "cuda" else "cpu"), default=0)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir("inductor") / f"up-to-{largest}"))
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank {rank}: %(message)s")
    import torch

    from shard import model as model_lib
    from shard.main_thread import MainThread
    from shard.runner import Runner
    from shard.server import ShardService, pick_device, serve
    from shard import rendezvous as meet

    dev = pick_device(device, rank)
    local = local_world_size or world_size
    if dev.type == "cpu" and local > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    store = meet.init_process_group(rank, world_size, rendezvous, dev) if world_size > 1 else None
    loaded = model_lib.load(model_dir, dtype, dev, rank, world_size, quantize)
    logging.getLogger("shard").info("loaded %s (%s, %s%s) on %s, %d KV heads on this rank", model_dir,
                                    loaded.config.model_type, loaded.dtype_name,
                                    f", {quantize} linears" if quantize else "", dev, loaded.kv_heads)
    runner = Runner(loaded, dev, block_size, rank, world_size, sizes.parse(compile_sizes, dev.type))
    main = MainThread()
    server, address = serve(ShardService(loaded, runner, world_size, main),
                            meet.tcp_address(rendezvous) if uds == "tcp" else uds)
    if store is not None and uds == "tcp":
        meet.publish(store, rank, address)
        meet.watch(store, rendezvous)
        logging.getLogger("shard").info("serving on %s (published in node 0's store)", address)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    main.run(stop)
    server.stop(grace=1).wait()
    if world_size > 1:
        torch.distributed.destroy_process_group()
    gc.freeze()  # the interpreter's last collection walks every object torch and transformers made: ~1 s to exit


if __name__ == "__main__":
    app()
