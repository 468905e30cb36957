"""The CPU kernels in C: decode attention (kernels/paged_decode.c) and greedy sampling's reductions
(kernels/greedy.c), built once per machine with the system's C compiler, loaded with ctypes, called with raw
pointers to the step's tensors.

Decode attention reads each request's keys and values in place through its block table, once, where the torch
path gathers every decode group's blocks into a padded copy in every layer and reads that twice. Plain C and no
torch headers, so it compiles in about a second; ctypes releases the GIL during the call. Without a compiler (or
on a GPU) the shard keeps the torch paths, and says so once.
"""
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from shard import cpu

KERNELS = Path(__file__).with_name("kernels")
SOURCES = [KERNELS / "paged_decode.c", KERNELS / "greedy.c"]
HEADERS = [KERNELS / "exp.h"]
DTYPES = (torch.float32, torch.bfloat16)  # the caches it reads
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno"]
log = logging.getLogger("cb.shard")

_lib = None
_tried = False


def _build() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: decode attention gathers the cache and sampling stays in torch (slower)")
        return None
    source = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    key = hashlib.sha256(source + " ".join([compiler, *FLAGS, platform.machine(), *sorted(cpu.flags())]).encode())
    target = cpu.cache_dir("kernels") / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # shards build at once: rename is atomic
            built = Path(tmp) / target.name
            done = subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", str(built), "-lm"],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                log.warning("building the CPU kernels failed, decode attention gathers the cache instead:\n%s",
                            done.stderr[-2000:])
                return None
            os.replace(built, target)
    lib = ctypes.CDLL(str(target))
    lib.paged_decode.restype = ctypes.c_int
    lib.greedy_rows.restype = ctypes.c_int
    return lib


def available(device: torch.device) -> bool:
    global _lib, _tried
    if device.type != "cpu" or os.environ.get("CB_PAGED_KERNEL", "1") == "0":
        return False
    if not _tried:
        _tried = True
        _lib = _build()
    return _lib is not None


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def decode(q: torch.Tensor, rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           tables: torch.Tensor, key_start: torch.Tensor, kv_len: torch.Tensor, window: int | None,
           out: torch.Tensor, scale: float) -> bool:
    """q and out [H, T, D] (any strides, the cache's dtype), rows/key_start/kv_len [B] and tables [B, W] int64
    (contiguous), caches [Hkv, blocks, block_size, D] contiguous. Writes each request's attention output at its
    row of `out`; False when the shape is beyond the kernel (the caller takes the torch path)."""
    hkv, nb, bs, dim = k_cache.shape
    heads = q.shape[0]
    return _lib.paged_decode(
        _ptr(q), ctypes.c_long(q.stride(0)), ctypes.c_long(q.stride(1)), _ptr(rows), _ptr(k_cache), _ptr(v_cache),
        ctypes.c_long(nb), ctypes.c_long(bs), _ptr(tables), ctypes.c_long(tables.shape[1]), _ptr(key_start),
        _ptr(kv_len), ctypes.c_long(window or 0), _ptr(out), ctypes.c_long(out.stride(0)),
        ctypes.c_long(out.stride(1)), ctypes.c_long(rows.shape[0]), ctypes.c_long(hkv),
        ctypes.c_long(heads // hkv), ctypes.c_long(dim), ctypes.c_float(scale),
        ctypes.c_int(k_cache.dtype == torch.bfloat16), ctypes.c_int(torch.get_num_threads())) == 0


def greedy(logits: torch.Tensor) -> tuple[list[int], list[float]] | None:
    """Each row's argmax (its first largest value) and that token's log-probability, for float32 or bfloat16 CPU
    logits [rows, vocab] with unit column stride (NaN an impossible token, as sampling.finite makes it; sums in
    float32); None where the kernel is not there or a row's largest value is infinite (the caller's torch path
    gives those their meaning)."""
    if not available(logits.device) or logits.dtype not in DTYPES or logits.dim() != 2 or logits.stride(1) != 1:
        return None
    rows = logits.shape[0]
    tokens = torch.empty(rows, dtype=torch.int64)
    logprobs = torch.empty(rows, dtype=torch.float32)
    if _lib.greedy_rows(_ptr(logits), ctypes.c_long(rows), ctypes.c_long(logits.shape[1]),
                        ctypes.c_long(logits.stride(0)), ctypes.c_int(logits.dtype == torch.bfloat16),
                        _ptr(tokens), _ptr(logprobs),
                        ctypes.c_int(torch.get_num_threads())) != 0:
        return None
    return tokens.tolist(), logprobs.tolist()
