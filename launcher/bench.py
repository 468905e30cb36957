"""cb-bench: replay the shared W64 workload through a running cb server and report throughput/latency.

Every system under comparison replays the same workload.json (same prompts, same max_new_tokens,
EOS ignored), so numbers are comparable. The optional "ceiling" measures what plain transformers can
do on this machine for one decode step / one prefill, to put the server's throughput in context.
"""
from __future__ import annotations

import asyncio
import json
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx
import typer

DEFAULT_WORKLOAD = Path(__file__).resolve().parents[1].parent / "shared/bench/workload.json"

app = typer.Typer(add_completion=False, help=__doc__)


def load_workload(path: Path) -> list[dict]:
    """Read the canonical workload; fail early on a malformed file rather than mid-run."""
    reqs = json.loads(Path(path).read_text())["requests"]
    for r in reqs:
        if not r["prompt_ids"] or int(r["max_new_tokens"]) < 1:
            raise ValueError(f"bad request in workload: id={r.get('id')}")
    return reqs


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), so p50 of an even list is the midpoint."""
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def one_request(client: httpx.AsyncClient, url: str, req: dict, sem: asyncio.Semaphore) -> dict:
    """Stream one request; timestamps are taken on arrival of each SSE token event."""
    body = {"inputs": req["prompt_ids"],
            "parameters": {"max_new_tokens": req["max_new_tokens"], "ignore_eos": True, "details": True}}
    rec = {"id": req["id"], "prompt_tokens": len(req["prompt_ids"]), "max_new_tokens": req["max_new_tokens"],
           "tokens": 0, "ttft": None, "itl": [], "e2e": None, "finish_reason": None,
           "generated_tokens": None, "error": None}
    async with sem:
        t0 = time.perf_counter()
        last = None
        try:
            async with client.stream("POST", f"{url}/generate_stream", json=body) as resp:
                if resp.status_code != 200:
                    raw = await resp.aread()
                    try:
                        err = json.loads(raw)
                        rec["error"] = f"{err.get('error_type')}: {err.get('error')}"
                    except ValueError:
                        rec["error"] = f"HTTP {resp.status_code}: {raw[:200]!r}"
                else:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        now = time.perf_counter()
                        ev = json.loads(line[5:])
                        if "error" in ev and ev.get("error") is not None:
                            rec["error"] = f"{ev.get('error_type')}: {ev['error']}"
                            break
                        if ev.get("token") is not None:
                            rec["tokens"] += 1
                            if last is None:
                                rec["ttft"] = now - t0
                            else:
                                rec["itl"].append(now - last)
                            last = now
                        if ev.get("generated_text") is not None:
                            details = ev.get("details") or {}
                            rec["finish_reason"] = details.get("finish_reason")
                            rec["generated_tokens"] = details.get("generated_tokens")
        except (httpx.HTTPError, ValueError) as e:
            rec["error"] = f"{type(e).__name__}: {e}"
        rec["e2e"] = time.perf_counter() - t0
    return rec


async def replay(url: str, reqs: list[dict], concurrency: Optional[int]) -> tuple[list[dict], float]:
    """Fire all requests at once (or capped by a semaphore); wall time spans first send to last finish."""
    n = concurrency or len(reqs)
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    timeout = httpx.Timeout(3600.0, connect=60.0)
    sem = asyncio.Semaphore(n)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        t0 = time.perf_counter()
        recs = await asyncio.gather(*(one_request(client, url, r, sem) for r in reqs))
        wall = time.perf_counter() - t0
    return list(recs), wall


def is_mismatch(rec: dict) -> bool:
    """A request is wrong if it errored, or the stream or the details disagree with max_new_tokens."""
    want = rec["max_new_tokens"]
    return (rec["error"] is not None or rec["tokens"] != want
            or (rec["generated_tokens"] is not None and rec["generated_tokens"] != want))


def summarize(recs: list[dict], wall: float) -> dict:
    ttft = [r["ttft"] for r in recs if r["ttft"] is not None]
    itl = [x for r in recs for x in r["itl"]]
    e2e = [r["e2e"] for r in recs if r["error"] is None]
    out_tokens = sum(r["tokens"] for r in recs)
    return {
        "requests": len(recs), "wall_s": wall,
        "input_tokens": sum(r["prompt_tokens"] for r in recs),
        "output_tokens": out_tokens, "expected_output_tokens": sum(r["max_new_tokens"] for r in recs),
        "output_tok_s": out_tokens / wall, "req_s": len(recs) / wall,
        "ttft_p50_ms": percentile(ttft, 50) * 1e3, "ttft_p99_ms": percentile(ttft, 99) * 1e3,
        "itl_p50_ms": percentile(itl, 50) * 1e3, "itl_p99_ms": percentile(itl, 99) * 1e3,
        "e2e_p50_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99),
        "errors": sum(r["error"] is not None for r in recs),
        "mismatches": sum(is_mismatch(r) for r in recs),
    }


def measure_ceiling(model_dir: str, dtype: str, device: str, batch: int = 64, ctx: int = 256,
                    prefill_len: int = 512, runs: int = 5) -> dict:
    """Time bare transformers forwards: the best a server could do without batching overheads."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype),
                                                 attn_implementation="sdpa").to(device).eval()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def timed(fn) -> float:
        fn()  # warm-up
        ts = []
        for _ in range(runs):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    with torch.inference_mode():
        # (a) decode: one step of `batch` sequences over a `ctx`-token cache; crop keeps the cache at ctx.
        ids = torch.randint(100, vocab - 100, (batch, ctx), generator=gen).to(device)
        cache = model(ids, use_cache=True, logits_to_keep=1).past_key_values
        step = torch.randint(100, vocab - 100, (batch, 1), generator=gen).to(device)
        mask = torch.ones(batch, ctx + 1, dtype=torch.long, device=device)

        def decode():
            model(step, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache.crop(ctx)

        t_dec = timed(decode)
        del cache
        # (b) prefill: one sequence of prefill_len tokens, no cache reuse.
        pids = torch.randint(100, vocab - 100, (1, prefill_len), generator=gen).to(device)
        t_pre = timed(lambda: model(pids, use_cache=True, logits_to_keep=1))
    return {"model_dir": str(model_dir), "dtype": dtype, "device": device,
            "decode_step_s": t_dec, "decode_tok_s": batch / t_dec, "decode_batch": batch, "decode_ctx": ctx,
            "prefill_s": t_pre, "prefill_tok_s": prefill_len / t_pre, "prefill_len": prefill_len}


def launch_server(port: int, dtype: str, extra: list[str], url: str) -> subprocess.Popen:
    """Start `python -m launcher` and block until /health answers 200 (or the process dies)."""
    cmd = [sys.executable, "-m", "launcher", "--port", str(port), "--dtype", dtype, *extra]
    typer.echo(f"launching: {shlex.join(cmd)}")
    proc = subprocess.Popen(cmd)
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


@app.command()
def main(
    url: Optional[str] = typer.Option(None, help="Server URL (default http://127.0.0.1:PORT)."),
    port: int = typer.Option(8080, help="Port, used for --launch and the default URL."),
    workload: Path = typer.Option(DEFAULT_WORKLOAD, help="Workload JSON file."),
    concurrency: Optional[int] = typer.Option(None, help="Max in-flight requests (default: all at once)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write results as JSON here."),
    ceiling: bool = typer.Option(True, help="After the replay, measure the bare-transformers forward ceiling."),
    model_dir: Optional[str] = typer.Option(None, help="Model dir for the ceiling (default: resolve_model('smollm2'))."),
    dtype: str = typer.Option("bfloat16", help="dtype for the ceiling and for --launch."),
    device: Optional[str] = typer.Option(None, help="Ceiling device (default: cuda if available, else cpu)."),
    launch: bool = typer.Option(False, help="Start the server with `python -m launcher` first."),
    launcher_args: str = typer.Option("", help="Extra launcher args (shell-quoted string)."),
):
    url = (url or f"http://127.0.0.1:{port}").rstrip("/")
    reqs = load_workload(workload)
    typer.echo(f"workload: {workload} ({len(reqs)} requests, "
               f"{sum(len(r['prompt_ids']) for r in reqs)} prompt tokens, "
               f"{sum(r['max_new_tokens'] for r in reqs)} output tokens)")
    proc = launch_server(port, dtype, shlex.split(launcher_args), url) if launch else None
    try:
        recs, wall = asyncio.run(replay(url, reqs, concurrency))
    finally:
        if proc is not None:
            stop_server(proc)  # also frees the accelerator before the ceiling run
    s = summarize(recs, wall)
    typer.echo(f"wall time      {s['wall_s']:.2f} s")
    typer.echo(f"output tokens  {s['output_tokens']} / {s['expected_output_tokens']}  "
               f"-> {s['output_tok_s']:.1f} tok/s")
    typer.echo(f"input tokens   {s['input_tokens']}")
    typer.echo(f"requests/s     {s['req_s']:.3f}")
    typer.echo(f"TTFT  p50 {s['ttft_p50_ms']:.1f} ms  p99 {s['ttft_p99_ms']:.1f} ms")
    typer.echo(f"ITL   p50 {s['itl_p50_ms']:.1f} ms  p99 {s['itl_p99_ms']:.1f} ms")
    typer.echo(f"E2E   p50 {s['e2e_p50_s']:.2f} s  p99 {s['e2e_p99_s']:.2f} s")
    typer.echo(f"errors {s['errors']}  mismatches {s['mismatches']}")
    for r in recs:
        if is_mismatch(r):
            typer.echo(f"  id={r['id']} got {r['tokens']}/{r['max_new_tokens']} tokens"
                       f" details={r['generated_tokens']} error={r['error']}", err=True)
    result = {"url": url, "workload": str(workload), "summary": s, "requests": recs}
    if ceiling:
        if model_dir is None:
            from launcher.model_files import resolve_model
            model_dir = str(resolve_model("smollm2"))
        if device is None:
            import torch
            device = "cuda" if torch.cuda.is_available() else "cpu"
        c = measure_ceiling(model_dir, dtype, device)
        result["ceiling"] = c
        typer.echo(f"ceiling ({dtype}, {device}): decode b{c['decode_batch']}@{c['decode_ctx']} "
                   f"{c['decode_step_s'] * 1e3:.1f} ms/step = {c['decode_tok_s']:.1f} tok/s; "
                   f"prefill {c['prefill_len']} {c['prefill_s'] * 1e3:.1f} ms = {c['prefill_tok_s']:.1f} tok/s")
    if json_out is not None:
        json_out.write_text(json.dumps(result, indent=2))
    if s["mismatches"]:
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
