"""`cb-launcher`: converts the model once, starts the shards and then the router, and supervises them."""
import enum
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional

import typer

from launcher.children import log
from launcher.model_files import ModelNotFoundError, resolve_model
from launcher.readiness import router_url
from launcher.supervisor import Supervisor

app = typer.Typer(add_completion=False)


class Dtype(str, enum.Enum):
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class Policy(str, enum.Enum):
    fifo = "fifo"                    # decodes, then chunked prompts, then new requests by priority and arrival
    prefill_first = "prefill_first"  # chunked prompts first, then decodes, then new requests


class Device(str, enum.Enum):
    auto = "auto"  # the shard picks cuda when it is available
    cpu = "cpu"
    cuda = "cuda"


def as_flags(**flags) -> list[str]:
    """`--flag value` pairs in the children's CLI spelling; a None value leaves its flag out."""
    return [arg for name, value in flags.items() if value is not None
            for arg in (f"--{name.replace('_', '-')}", str(value))]


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
        0.9, envvar="MAX_MEMORY_PERCENT", min=0.01, max=1.0, help="fraction of free memory the KV cache may take"),
    graceful_timeout: float = typer.Option(
        30.0, envvar="GRACEFUL_TIMEOUT", help="s in-flight requests get to finish on shutdown"),
    master_port: int = typer.Option(29500, envvar="MASTER_PORT", help="torch.distributed rendezvous"),
    uds_dir: Optional[Path] = typer.Option(
        None, envvar="UDS_DIR", help="where the shard sockets go; default: a fresh temp dir"),
    trace_file: Optional[Path] = typer.Option(
        None, envvar="TRACE_FILE", help="the router writes every scheduling decision here (JSON lines, for cb-sim)"),
    api_key: Optional[str] = typer.Option(
        None, envvar="API_KEY", help="require `Authorization: Bearer KEY` on every route but /health /metrics /info"),
    payload_limit: int = typer.Option(2_000_000, envvar="PAYLOAD_LIMIT", help="largest request body, bytes"),
    max_stop_sequences: int = typer.Option(4, envvar="MAX_STOP_SEQUENCES"),
    max_top_n_tokens: int = typer.Option(5, envvar="MAX_TOP_N_TOKENS"),
    prefix_caching: bool = typer.Option(True, envvar="PREFIX_CACHING",
                                        help="share the KV blocks of common prompt prefixes (full-attention models)"),
    num_blocks: Optional[int] = typer.Option(
        None, envvar="NUM_BLOCKS", min=1, help="KV blocks in the pool (overrides --max-batch-total-tokens sizing)"),
    scheduler: Policy = typer.Option(Policy.fifo, envvar="SCHEDULER", help="order of work within a step"),
    safety_margin: Optional[float] = typer.Option(
        None, envvar="SAFETY_MARGIN", min=0.0, max=1.0,
        help="hold new prompts while free KV blocks are below this fraction (default: fifo 0.15, prefill_first 0)"),
    cpu_offload_space: float = typer.Option(
        4.0, envvar="CPU_OFFLOAD_SPACE", min=0.0,
        help="GiB of host memory per shard for offloaded requests' KV blocks (0: soft reset instead)"),
):
    """Serves --model-id over HTTP with continuous batching across --num-shard shard processes."""
    try:
        model_dir = resolve_model(model_id)
    except ModelNotFoundError as error:
        log("launcher", f"error: {error}")
        raise typer.Exit(2) from None
    own_uds_dir = uds_dir is None
    uds_dir = Path(tempfile.mkdtemp(prefix="cb-")) if own_uds_dir else uds_dir
    uds_dir.mkdir(parents=True, exist_ok=True)
    sockets = [str(uds_dir / f"shard-{rank}.sock") for rank in range(num_shard)]
    shard_argvs = [[sys.executable, "-m", "shard", *as_flags(
        model_dir=model_dir, rank=rank, world_size=num_shard, uds=sockets[rank], master_addr="127.0.0.1",
        master_port=master_port, dtype=dtype.value, device=device.value, block_size=block_size)]
        for rank in range(num_shard)]
    router_argv = [sys.executable, "-m", "router", *as_flags(
        model_dir=model_dir, uds=",".join(sockets), port=port, hostname=hostname,
        max_concurrent_requests=max_concurrent_requests, max_input_tokens=max_input_tokens,
        max_total_tokens=max_total_tokens, max_batch_prefill_tokens=max_batch_prefill_tokens,
        max_batch_total_tokens=max_batch_total_tokens, max_batch_size=max_batch_size,
        waiting_served_ratio=waiting_served_ratio, max_waiting_tokens=max_waiting_tokens,
        block_size=block_size, max_memory_percent=max_memory_percent, graceful_timeout=graceful_timeout,
        trace_file=trace_file, payload_limit=payload_limit,
        max_stop_sequences=max_stop_sequences, max_top_n_tokens=max_top_n_tokens, num_blocks=num_blocks,
        scheduler=scheduler.value, safety_margin=safety_margin, cpu_offload_space=cpu_offload_space)]
    router_argv.append("--prefix-caching" if prefix_caching else "--no-prefix-caching")

    if api_key:
        os.environ["API_KEY"] = api_key  # the router reads it from its environment, not from a visible argv
    log("launcher", f"starting {num_shard} shard(s) from {model_dir} ({dtype.value}, device {device.value})")
    try:
        code = Supervisor().run(shard_argvs, sockets, router_argv, router_url(hostname, port), graceful_timeout)
    finally:
        if own_uds_dir:
            shutil.rmtree(uds_dir, ignore_errors=True)
        else:
            for path in sockets:
                Path(path).unlink(missing_ok=True)
    raise typer.Exit(code)
