"""In-process baselines for cb-bench: the same workload and arrivals, run without cb, on the same machine.

- `static`: Hugging Face `generate` in static padded batches: when idle, take up to `batch_size` requests that have
  arrived, left-pad them to the longest prompt and generate until the longest `max_new_tokens` is reached (EOS
  blocked by `min_new_tokens`). A stopping criterion timestamps every step, so TTFT/ITL are what a streaming
  static server would show; the batch returns together, so E2E is the end of its group.
- `transformers-cb`: transformers' own continuous batching, the manager behind `model.generate_batch`
  (`init_continuous_batching`), driven directly so each request gets its own `max_new_tokens` and every streamed
  token is timestamped. On CPU its cache sizing asks CUDA for free memory and fails; we answer with a fixed size.
Both return cb-bench records (see bench_stats) and the wall time from the first arrival to the last token.
"""
from __future__ import annotations

import sys
import threading
import time
from collections import deque
from typing import Optional

from bench.stats import new_record
from bench.workloads import Req, token_ids

BASELINES = ("static", "transformers-cb")


def _stamp(rec: dict, times: list[float], t_arrival: float) -> None:
    """Token k arrived at times[k] (absolute perf_counter)."""
    rec["tokens"] = len(times)
    rec["generated_tokens"] = len(times)
    if times:
        rec["ttft"] = times[0] - t_arrival
        rec["itl"] = [b - a for a, b in zip(times, times[1:])]
        rec["e2e"] = times[-1] - t_arrival
        rec["finish_reason"] = "length"


def _bar(n: int, desc: str, progress: bool):
    if not progress:
        return None
    from tqdm import tqdm
    return tqdm(total=n, desc=desc, unit="req", file=sys.stderr, leave=False)


def load_model(model_dir: str, dtype: str, device: str, attn: str):
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype),
                                                attn_implementation=attn).to(device).eval()


def run_static(reqs: list[Req], arrivals: list[float], model_dir: str, dtype: str, device: str,
               batch_size: int, progress: bool = True) -> tuple[list[dict], float]:
    import torch
    from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

    model = load_model(model_dir, dtype, device, "sdpa")
    pad = 0
    stamps: list[float] = []

    class Clock(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def generate(group: list[Req]) -> None:
        p = max(len(token_ids(r)) for r in group)
        m = max(r.max_new_tokens for r in group)
        ids = torch.full((len(group), p), pad, dtype=torch.long)
        mask = torch.zeros((len(group), p), dtype=torch.long)
        for row, r in enumerate(group):
            x = token_ids(r)
            ids[row, p - len(x):] = torch.tensor(x)
            mask[row, p - len(x):] = 1
        cfg = GenerationConfig(max_new_tokens=m, min_new_tokens=m, do_sample=False, pad_token_id=pad,
                               eos_token_id=model.generation_config.eos_token_id)
        with torch.inference_mode():
            model.generate(ids.to(device), attention_mask=mask.to(device), generation_config=cfg,
                           stopping_criteria=StoppingCriteriaList([Clock()]))

    generate([Req(-1, 8, 4, prompt_ids=list(range(100, 108)))])  # warm-up, outside the timed run
    order = deque(sorted(range(len(reqs)), key=lambda i: (arrivals[i], i)))
    records = {}
    bar = _bar(len(reqs), f"static b{batch_size}", progress)
    t_run = time.perf_counter()
    while order:
        wait = t_run + arrivals[order[0]] - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        now = time.perf_counter() - t_run
        group = []
        while order and len(group) < batch_size and arrivals[order[0]] <= now:
            group.append(order.popleft())
        stamps.clear()
        generate([reqs[i] for i in group])
        end = time.perf_counter()
        for i in group:
            r = reqs[i]
            rec = records[r.id] = new_record(r, arrivals[i])
            _stamp(rec, stamps[:r.max_new_tokens], t_run + arrivals[i])
            rec["e2e"] = end - (t_run + arrivals[i])  # a static batch returns together
        if bar is not None:
            bar.update(len(group))
    wall = time.perf_counter() - t_run
    if bar is not None:
        bar.close()
    return [records[r.id] for r in reqs], wall


def _patch_cpu_memory(total_bytes: int) -> None:
    """transformers 4.57 sizes its paged cache from CUDA's free memory even on CPU (total is None there)."""
    from transformers.generation.continuous_batching import cache
    cache.PagedAttentionMemoryHandler.get_available_memory = staticmethod(lambda max_memory_percent=1.0: total_bytes)


def run_transformers_cb(reqs: list[Req], arrivals: list[float], model_dir: str, dtype: str, device: str,
                        num_blocks: int, block_size: int, max_batch_tokens: int,
                        progress: bool = True) -> tuple[list[dict], float]:
    from transformers import GenerationConfig

    if not device.startswith("cuda"):
        _patch_cpu_memory(16 << 30)
    model = load_model(model_dir, dtype, device, "sdpa_paged")
    cfg = GenerationConfig(max_new_tokens=max(r.max_new_tokens for r in reqs), do_sample=False, eos_token_id=-1,
                           pad_token_id=0, num_blocks=num_blocks, block_size=block_size,
                           max_batch_tokens=max_batch_tokens, scheduler="fifo")
    mgr = model.init_continuous_batching(generation_config=cfg, streaming=True)
    mgr.start()
    stamps: dict[str, list[float]] = {str(r.id): [] for r in reqs}
    added: dict[str, float] = {}
    errors: dict[str, str] = {}
    try:
        _warm_up(mgr)
        bar = _bar(len(reqs), "transformers-cb", progress)
        t_run = time.perf_counter()
        threading.Thread(target=_feed, args=(mgr, reqs, arrivals, t_run, added), daemon=True).start()
        _collect(mgr, len(reqs), stamps, errors, bar)
        wall = time.perf_counter() - t_run
        if bar is not None:
            bar.close()
    finally:
        mgr.stop(block=True, timeout=10)
    records = []
    for i, r in enumerate(reqs):
        rec = new_record(r, arrivals[i])
        _stamp(rec, stamps[str(r.id)], added.get(str(r.id), t_run + arrivals[i]))
        if str(r.id) in errors or len(stamps[str(r.id)]) < r.max_new_tokens:
            rec["error"] = errors.get(str(r.id), f"incomplete: {len(stamps[str(r.id)])}/{r.max_new_tokens} tokens")
        records.append(rec)
    return records, wall


def _warm_up(mgr) -> None:
    """The cache is built in the manager's thread: wait for its first answer."""
    from transformers.generation.continuous_batching.requests import RequestStatus

    mgr.add_request(list(range(100, 108)), request_id="warmup", max_new_tokens=4)
    while True:
        out = mgr.get_result(timeout=120)
        if out is None:
            raise RuntimeError("transformers continuous batching did not answer its warm-up request")
        if out.request_id == "warmup" and out.status == RequestStatus.FINISHED:
            return


def _feed(mgr, reqs: list[Req], arrivals: list[float], t_run: float, added: dict[str, float]) -> None:
    for i in sorted(range(len(reqs)), key=lambda i: (arrivals[i], i)):
        wait = t_run + arrivals[i] - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        added[str(reqs[i].id)] = time.perf_counter()
        mgr.add_request(token_ids(reqs[i]), request_id=str(reqs[i].id), max_new_tokens=reqs[i].max_new_tokens)


def _collect(mgr, n: int, stamps: dict[str, list[float]], errors: dict[str, str], bar) -> None:
    """Timestamps every streamed token on arrival until n requests have ended (or the manager stopped)."""
    from transformers.generation.continuous_batching.requests import RequestStatus

    finished = 0
    while finished < n:
        out = mgr.get_result(timeout=5)
        now = time.perf_counter()
        if out is None:
            if not mgr.is_running():
                return
            continue
        times = stamps.get(out.request_id)
        if times is None:
            continue
        while len(times) < len(out.generated_tokens):
            times.append(now)
        if out.status == RequestStatus.FAILED:
            errors[out.request_id] = f"transformers: {out.error}"
        if out.status in (RequestStatus.FINISHED, RequestStatus.FAILED):
            finished += 1
            if bar is not None:
                bar.update(1)


def local_device(device: Optional[str]) -> str:
    """Where the in-process runs (baselines, the ceiling) go: the one asked for, else cuda when there is one."""
    import torch
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def run(name: str, reqs: list[Req], arrivals: list[float], model_dir: str, dtype: str, device: Optional[str],
        batch_size: int, num_blocks: int, block_size: int, max_batch_tokens: int, progress: bool = True):
    device = local_device(device)
    if name == "static":
        return run_static(reqs, arrivals, model_dir, dtype, device, batch_size, progress)
    if name == "transformers-cb":
        return run_transformers_cb(reqs, arrivals, model_dir, dtype, device, num_blocks, block_size,
                                   max_batch_tokens, progress)
    raise ValueError(f"unknown baseline {name!r}: one of {', '.join(BASELINES)}")
