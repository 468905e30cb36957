"""The forward ceiling: bare transformers forwards on this machine, the best a server could do without batching
overheads (one decode step of a batch over a fixed cache, one prefill), to put cb-bench's throughput in context."""
from __future__ import annotations

import statistics
import time


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
