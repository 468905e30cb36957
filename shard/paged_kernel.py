"""The CPU kernels in C: decode and prompt-chunk attention (kernels/paged_decode.c, kernels/paged_prefill.c) and
greedy sampling's reductions (kernels/greedy.c), built once per machine with the system's C compiler, loaded with
ctypes, called with raw pointers to the step's tensors.

Decode attention reads each request's keys and values in place through its block table, once, where the torch
path gathers every decode group's blocks into a padded copy in every layer and reads that twice. Plain C and no
torch headers, so it compiles in about a second; ctypes releases the GIL during the call.

They are only ever a speed-up, so no step of building or loading them may stop a shard: without a compiler, when
the compiler fails or runs past COMPILE_TIMEOUT, when the library will not load or lacks a function, the shard
keeps the torch paths and one warning says why (on a GPU, or with CB_PAGED_KERNEL=0, it keeps them unasked). A
cache folder that cannot be written or read costs only the cache: the library is built for this process in a
temporary folder.
"""
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import torch

from shard import cpu

KERNELS = Path(__file__).with_name("kernels")
SOURCES = [KERNELS / "paged_decode.c", KERNELS / "paged_prefill.c", KERNELS / "greedy.c"]
HEADERS = [KERNELS / "exp.h", KERNELS / "paged.h", KERNELS / "vec.h"]
SYMBOLS = ("paged_decode", "paged_prefill", "greedy_rows")  # each returns int: 0 done, else declined
DTYPES = (torch.float32, torch.bfloat16)  # the caches it reads
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno"]
COMPILE_TIMEOUT = 60.0  # s; a build takes ~1 s, though every rank of a set builds at once, maybe on a busy machine
log = logging.getLogger("cb.shard")

_lib = None
_tried = False


class Unavailable(Exception):
    """Why the kernels cannot be used here (the shard then keeps the torch paths)."""


def _compiler() -> str:
    """$CC, else cc or gcc, as a path."""
    name = os.environ.get("CC")
    found = shutil.which(name) if name else shutil.which("cc") or shutil.which("gcc")
    if found is None:
        raise Unavailable(f"no C compiler: {f'$CC ({name}) not found' if name else 'neither cc nor gcc found'}")
    return found


def _compile(compiler: str, out: Path) -> Path:
    """Builds the library at `out`. The compiler runs in a session of its own so that a timeout ends all of it
    (gcc's cc1 and as too, which would otherwise hold its pipe open)."""
    command = [compiler, *FLAGS, *map(str, SOURCES), "-o", str(out), "-lm"]
    try:
        with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              errors="replace", start_new_session=True) as proc:
            try:
                _, err = proc.communicate(timeout=COMPILE_TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                raise Unavailable(f"{compiler} ran past {COMPILE_TIMEOUT:g} s") from None
    except OSError as error:
        raise Unavailable(f"running {compiler} failed: {error}") from None
    if proc.returncode != 0:
        raise Unavailable(f"{compiler} exited {proc.returncode}:\n{err[-2000:].strip()}")
    return out


def _open(path: Path) -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(str(path))
        for name in SYMBOLS:
            getattr(lib, name).restype = ctypes.c_int
    except (OSError, AttributeError) as error:
        raise Unavailable(f"loading {path} failed: {error}") from None
    return lib


def _cached(compiler: str, name: str) -> Path:
    """The library in the cache folder, built there first when no process has yet."""
    target = cpu.cache_dir("kernels") / name
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # shards build at once: rename is atomic
            os.replace(_compile(compiler, Path(tmp) / name), target)
    return target


def _load() -> ctypes.CDLL:
    compiler = _compiler()
    try:
        source = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    except OSError as error:
        raise Unavailable(f"the kernels' sources cannot be read: {error}") from None
    key = hashlib.sha256(source + " ".join([compiler, *FLAGS, platform.machine(), *sorted(cpu.flags())]).encode())
    name = f"cpu_kernels-{key.hexdigest()[:16]}.so"
    try:
        path = _cached(compiler, name)
    except OSError as error:  # the cache folder: built for this process alone
        with tempfile.TemporaryDirectory(prefix="cb-kernels-") as tmp:
            lib = _open(_compile(compiler, Path(tmp) / name))  # once loaded, the file may go
        log.warning("the CPU kernels' cache folder %s cannot be used (%s): built in a temporary folder, as they "
                    "will be at every start", cpu.cache_dir("kernels"), error)
        return lib
    return _open(path)


def available(device: torch.device) -> bool:
    global _lib, _tried
    if device.type != "cpu" or os.environ.get("CB_PAGED_KERNEL", "1") == "0":
        return False
    if not _tried:
        _tried = True
        try:
            _lib = _load()
        except Exception as error:  # anything at all: the kernels only ever speed up what torch does anyway
            reason = str(error) if isinstance(error, Unavailable) else f"{type(error).__name__}: {error}"
            log.warning("CPU kernels off (decode attention gathers the cache, sampling stays in torch: slower): %s",
                        reason)
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


def prefill(q: torch.Tensor, rows: torch.Tensor, count: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, tables: torch.Tensor, key_start: torch.Tensor, window: int | None,
            out: torch.Tensor, scale: float) -> bool:
    """Prompt chunks: chunk b's `count[b]` queries sit at rows rows[b].. of q and out and at positions pos[b]..;
    each attends causally to its keys (and inside the window). Layouts as in `decode`; False when the kernel
    declines (the caller takes the torch path)."""
    hkv, nb, bs, dim = k_cache.shape
    return _lib.paged_prefill(
        _ptr(q), ctypes.c_long(q.stride(0)), ctypes.c_long(q.stride(1)), _ptr(rows), _ptr(count), _ptr(pos),
        _ptr(k_cache), _ptr(v_cache), ctypes.c_long(nb), ctypes.c_long(bs), _ptr(tables),
        ctypes.c_long(tables.shape[1]), _ptr(key_start), ctypes.c_long(window or 0), _ptr(out),
        ctypes.c_long(out.stride(0)), ctypes.c_long(out.stride(1)), ctypes.c_long(rows.shape[0]), ctypes.c_long(hkv),
        ctypes.c_long(q.shape[0] // hkv), ctypes.c_long(dim), ctypes.c_float(scale),
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
