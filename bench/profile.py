"""Where a shard's step time goes (`make profile`, `python -m bench.profile`): a decode step at batch 1 and 64 over
a cached context, and a whole-prompt prefill, each timed on a shard's Runner in-process and split with
torch.profiler into: building the step's layout, each kind of op in the layers (projections, MLP, norms, the
rest), attention (cache writes, gathers, the attention maths), the LM head and sampling. The same decode steps
then go through a real shard gRPC server on a unix socket, so the cost of the transport and the message
conversions shows beside the forward.

Numbers for the README's performance section and the speed work, never for tests.
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional

import typer

from router.settings import Settings

app = typer.Typer(add_completion=False, rich_markup_mode=None, help=__doc__)
DEFAULTS = Settings()
MODULES = (("embed", "embedding"), ("lm_head", "LM head"), ("q_proj", "q/k/v projections"),
           ("k_proj", "q/k/v projections"), ("v_proj", "q/k/v projections"), ("qkv", "q/k/v projections"),
           ("o_proj", "output projection"), ("mlp", "MLP"), ("gate_up", "MLP"), ("down_proj", "MLP"),
           ("norm", "norms"), ("rotary", "rotary"))


def _tag(model) -> None:
    """While a profile is taken, each module whose name says what it is runs under a profiler scope of that name
    (innermost wins)."""
    from shard.profiling import scope

    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        label = next((label for key, label in MODULES if key in last), None)
        if label is None:
            continue
        scopes = []

        def enter(m, a, label=label, scopes=scopes):
            scopes.append(scope(f"module::{label}"))
            scopes[-1].__enter__()

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(lambda m, a, o, scopes=scopes: scopes.pop().__exit__(None, None, None))


def _breakdown(prof) -> dict[str, float]:
    """Self CPU time (µs) per innermost cb:: scope; ops outside any module scope count as 'other'. A scope's own
    self time counts too: what runs in it that is not a torch op (the decode kernel, Python)."""
    out: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.name.startswith("cb::") and ev.name != "cb::forward":
            out[ev.name.split("::")[-1]] += ev.self_cpu_time_total
            continue
        scope, parent = "other", ev.cpu_parent
        while parent is not None:
            if parent.name.startswith("cb::") and parent.name != "cb::forward":
                scope = parent.name.split("::")[-1]
                break
            parent = parent.cpu_parent
        out[scope] += ev.self_cpu_time_total
    return dict(out)


class Bench:
    """A Runner with `batch` requests each holding `context` tokens, ready for decode steps."""

    def __init__(self, model_dir: str, dtype: str, block_size: int, quantize: Optional[str] = None,
                 compile_sizes: str = "0"):
        import torch

        from shard import compile_sizes as sizes
        from shard.model import load
        from shard.runner import Runner

        self.device = torch.device("cpu")
        self.loaded = load(model_dir, dtype, self.device, 0, 1, quantize)
        self.runner = Runner(self.loaded, self.device, block_size, 0, 1, sizes.parse(compile_sizes, "cpu"))
        if self.runner.compiled and self.runner.compile():
            self.runner.go_live()
        self.block_size = block_size

    def prime(self, batch: int, context: int) -> list:
        """Fresh pools, `batch` requests prefilled to `context` tokens; returns their next decode entries."""
        from shard.sampling import Params
        from shard.step import Entry

        per = -(-(context + 64) // self.block_size)
        self.runner.allocate(batch * per + 1)
        self.runner.clear()
        entries = []
        for i in range(batch):
            blocks = list(range(i * per, (i + 1) * per))
            ids = [100 + (7 * i + k) % 40000 for k in range(context)]
            self.runner.step([Entry(i, ids, blocks, sample=True, params=Params())])
            entries.append(Entry(i, [200 + i], [], sample=True, cached_tokens=context))
        return entries

    def decode(self, entries: list) -> float:
        t = time.perf_counter()
        self.runner.step(entries)
        for e in entries:
            e.cached_tokens += 1
        return time.perf_counter() - t


def time_and_split(fn, steps: int) -> tuple[float, dict[str, float]]:
    """Median seconds per call (unprofiled), and each scope's share of it (from one profiled call)."""
    from torch.profiler import ProfilerActivity, profile

    from shard import profiling

    fn()  # warm-up
    times = [fn() for _ in range(steps)]
    profiling.enabled = True
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
    finally:
        profiling.enabled = False
    parts = _breakdown(prof)
    total = sum(parts.values()) or 1.0
    median = statistics.median(times)
    return median, {k: median * v / total for k, v in sorted(parts.items(), key=lambda kv: -kv[1])}


def grpc_decode(bench: Bench, batch: int, context: int, steps: int) -> tuple[float, float]:
    """(median seconds per Decode RPC seen by a client, median forward seconds the shard reported)."""
    import grpc

    from proto import generate_pb2 as pb
    from proto import generate_pb2_grpc as pb_grpc
    from shard.server import ShardService, serve

    entries = bench.prime(batch, context)
    with tempfile.TemporaryDirectory() as tmp:
        sock = str(Path(tmp) / "shard.sock")
        server, _ = serve(ShardService(bench.loaded, bench.runner, 1), sock)
        try:
            with grpc.insecure_channel(f"unix://{sock}") as channel:
                stub = pb_grpc.ShardStub(channel)
                rpc, forward = [], []
                for _ in range(steps + 1):
                    msg = pb.StepRequest(entries=[pb.StepEntry(id=e.id, input_ids=e.input_ids, sample=True,
                                                               cached_tokens=e.cached_tokens) for e in entries])
                    t = time.perf_counter()
                    resp = stub.Decode(msg)
                    rpc.append(time.perf_counter() - t)
                    forward.append(resp.forward_ns / 1e9)
                    for e in entries:
                        e.cached_tokens += 1
        finally:
            server.stop(None)
    return statistics.median(rpc[1:]), statistics.median(forward[1:])


def report(name: str, seconds: float, parts: dict[str, float], tokens: int) -> str:
    lines = [f"{name}: {seconds * 1e3:.1f} ms per step, {tokens / seconds:.0f} tok/s"]
    lines += [f"  {k:<22} {v * 1e3:8.2f} ms  {v / seconds:6.1%}" for k, v in parts.items()]
    return "\n".join(lines)


@app.command()
def main(model_id: str = typer.Option(DEFAULTS.model_id), dtype: str = typer.Option(DEFAULTS.dtype),
         quantize: Optional[str] = typer.Option(None, help="as the server's --quantize"),
         compile_sizes: str = typer.Option("0", help="as the server's --compile-sizes (a compiled step's ops show "
                                                     "as one lump: the split is the eager forward's)"),
         batches: str = typer.Option("1,64", help="decode batch sizes"),
         context: int = typer.Option(256, help="tokens each decoding request holds"),
         prefill: int = typer.Option(512, help="prompt tokens of the prefill step (0: no prefill case)"),
         steps: int = typer.Option(10, help="timed steps per case (median)"),
         json_out: Optional[Path] = typer.Option(None, "--json")):
    import torch

    from launcher.model_files import resolve_model
    from shard.sampling import Params
    from shard.step import Entry

    bench = Bench(str(resolve_model(model_id)), dtype, DEFAULTS.block_size, quantize, compile_sizes)
    _tag(bench.loaded.model)
    dtype = bench.loaded.dtype_name
    compiled = bench.runner.compiled.sizes if bench.runner.compiled else ()
    typer.echo(f"{model_id} ({dtype}{', ' + quantize if quantize else ''}), torch {torch.__version__}, "
               f"{torch.get_num_threads()} threads, compiled step sizes: {','.join(map(str, compiled)) or 'none'}")
    result = {"model_id": model_id, "dtype": dtype, "quantize": quantize, "threads": torch.get_num_threads(),
              "cases": {}}
    for batch in (int(b) for b in batches.split(",")):
        entries = bench.prime(batch, context)
        seconds, parts = time_and_split(lambda: bench.decode(entries), steps)
        rpc, forward = grpc_decode(bench, batch, context, steps)
        parts["gRPC + messages"] = max(0.0, rpc - forward)
        name = f"decode, batch {batch} x {context} cached"
        typer.echo(report(name, seconds, parts, batch))
        result["cases"][name] = {"seconds": seconds, "parts": parts, "rpc_seconds": rpc}

    def one_prefill() -> float:
        bench.runner.allocate(-(-prefill // bench.block_size) + 1)
        bench.runner.clear()
        ids = [100 + k % 40000 for k in range(prefill)]
        t = time.perf_counter()
        bench.runner.step([Entry(0, ids, list(range(-(-prefill // bench.block_size))), sample=True,
                                 params=Params())])
        return time.perf_counter() - t

    if prefill > 0:
        seconds, parts = time_and_split(one_prefill, max(3, steps // 3))
        typer.echo(report(f"prefill, {prefill} tokens", seconds, parts, prefill))
        result["cases"][f"prefill {prefill}"] = {"seconds": seconds, "parts": parts}
    if json_out:
        json_out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    app()
