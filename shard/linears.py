"""How the shard multiplies by a weight: at load, every nn.Linear of the model (tensor-parallel ones included) is
swapped for the fastest kernel this device has for the weight's mode.

- **bf16 on CPU** (`Packed`): oneDNN's own kernel with the weight laid out for it once, at load
  (`mkldnn._reorder_linear_weight`). `F.linear` hands oneDNN a plain weight, which it reorders on every call:
  the same kernel with the same sums (bit-identical logits), 1.3-2x faster for decode-sized batches. oneDNN
  packs bf16 only on CPUs with AVX-512 (or AVX-NE-CONVERT); elsewhere bf16 stays on `F.linear`.
- **float32 on CPU** (`Tuned`): the same product four ways, and for each row count the one measured fastest on
  this machine (`Plan`): `F.linear` on the weight stored transposed ([in, out] in memory, read as [out, in]: MKL's
  plain product, 1.3-2x the usual layout at 4-16 rows on a Xeon, where `F.linear` had MKL pack the weight on every
  call); the weight times the transposed rows; rows padded to a 64-row tile of a weight MKL packed once; oneDNN on
  a weight it laid out once (as vLLM's CPU backend runs fp32), which on a Zen 3 without AVX-512 ran the LM head
  2-4x and gate/up 1.2-2x MKL's speed from 4 to 512 rows. Every way sums in fp32 (the golden tests compare this
  mode with transformers). A weight is held only in the layouts its plan reads, and a plan reads both oneDNN's
  and the plain one only where that is 10% faster over the row counts than either alone (on the Zen 3 the down
  projection alone: a shard held 1,824 MB, 2,244 with each row count's pick, 1,847 before oneDNN). Compiled step
  sizes (compiled.py) follow the plan too, through an op the graph does not look into.
- **`--quantize int8`** (`Int8`): one scale per output channel, torch's int8-weight GEMM. Half the bytes of bf16.
- **`--quantize int4`** (`Int4`): groups of 32 input channels share a scale and a zero point (the layout of
  llama.cpp's Q4_1), torch's int4-weight GEMM for CPU. A quarter of the bytes of bf16; from ~8 requests at a
  time its GEMM is slower than bf16's. The LM head stays int8, as llama.cpp keeps its output matrix at 6 or 8
  bits: SmolLM2's perplexity on bench/data/quality.txt is 10.05 so, 10.69 with an int4 head, 10.06 in bf16.

Activations are never quantized, so a request's tokens do not depend on what shares its batch (in an fp32 model on
CPU they enter the quantized GEMMs rounded to bf16, row by row: those GEMMs are fast in bf16 only).
"""
import bisect
import fcntl
import hashlib
import itertools
import json
import os
import platform
import time
import types
import weakref
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from shard import cpu

MODES = ("int8", "int4")
INT4_GROUP = 32


_library = torch.library.Library("cb", "FRAGMENT")
_library.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


# for compiled step sizes: inductor lowers mkldnn's linear only on weights it froze and packed itself, and fails
# on a weight packed at load; through this op (no lowering, ~3 us a call) a graph calls the kernel as it is
_library.impl("packed_linear", _packed_linear, "CompositeExplicitAutograd")
torch.library.register_fake("cb::packed_linear", lambda x, weight, bias: x.new_empty((*x.shape[:-1], weight.shape[0])),
                            lib=_library)


class Packed(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.cb.packed_linear(x, self.weight, self.bias)
        return _packed_linear(x, self.weight, self.bias)


class Tuned(nn.Module):
    """float32 on CPU: each product goes the way measured fastest on this machine for its number of rows."""

    def __init__(self, linear: nn.Linear, plan: "Plan"):
        super().__init__()
        self.plan, self.bias = plan, linear.bias
        self.out_features = linear.out_features
        self.weight, self.packed, self.onednn = _layouts(linear.weight.detach(), set(plan.ways.values()))
        self.key = next(_keys)
        _tuned[self.key] = self

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [N, in] -> [N, out], the way the plan says for N."""
        if rows.shape[0] == 0:  # a prompt chunk whose rows' logits are all dropped
            return rows.new_empty((0, self.out_features))
        return _product(self.plan.way(rows.shape[0]), rows, self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        # a graph compiled for several step sizes (compiled.py) does not know its row count: the op looks it up
        y = torch.ops.cb.tuned_linear(rows, self.key) if torch.compiler.is_compiling() else self.product(rows)
        y = y if self.bias is None else y + self.bias
        return y.view(*x.shape[:-1], y.shape[-1])  # not -1: a step may keep no rows


_tuned: "weakref.WeakValueDictionary[int, Tuned]" = weakref.WeakValueDictionary()
_keys = itertools.count()
_library.define("tuned_linear(Tensor rows, int key) -> Tensor")
_library.impl("tuned_linear", lambda rows, key: _tuned[key].product(rows), "CompositeExplicitAutograd")
torch.library.register_fake("cb::tuned_linear",
                            lambda rows, key: rows.new_empty((rows.shape[0], _tuned[key].out_features)), lib=_library)

MEASURED_OUT = 16384  # output rows a plan is timed on at most (64 MiB at 1024 inputs: no cache holds it)
TILE = 64  # rows an MKL-packed weight is laid out for: its packed GEMM takes exactly that many
ONEDNN_ROWS = 32  # the row count oneDNN lays a weight out for (vLLM's choice; 1 ran 0.6-0.8x as fast at 8-64 rows)
PROBES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512)  # row counts timed; more take the last one's way


def _transposed(weight: torch.Tensor) -> torch.Tensor:
    """The [out, in] weight, its storage [in, out] (see the module's docstring)."""
    return weight.t().contiguous().t()


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkl._mkl_reorder_linear_weight(weight, TILE)


def _layouts(weight: torch.Tensor, ways: set[str]) -> tuple[Optional[torch.Tensor], ...]:
    """The [out, in] weight in the layouts `ways` read: stored transposed (F.linear, transposed, and tile beside its
    MKL-packed copy), and oneDNN's own."""
    plain = _transposed(weight) if ways - {"onednn"} else None
    packed = _pack(plain.contiguous()) if "tile" in ways else None
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ONEDNN_ROWS) if "onednn" in ways else None
    return plain, packed, onednn


def _product(way: str, rows: torch.Tensor, w) -> torch.Tensor:
    """rows @ weight.T four ways, on the layouts w holds (.weight, .packed, .onednn): F.linear (on the transposed
    storage, MKL's plain product), transposed (weight @ rows.T), tile (rows padded to TILE on the weight MKL packed
    once), onednn (oneDNN's GEMM on the weight it laid out once)."""
    if way == "onednn":
        return torch.ops.mkldnn._linear_pointwise(rows, w.onednn, None, "none", [], "")
    if way == "transposed":
        return torch.mm(w.weight, rows.t()).t().contiguous()
    if way == "tile":
        n = rows.shape[0]
        tile = nn.functional.pad(rows, (0, 0, 0, TILE - n)) if n < TILE else rows
        return torch.ops.mkl._mkl_linear(tile, w.packed, w.weight, None, TILE)[:n]
    return nn.functional.linear(rows, w.weight)


class Plan:
    """The way each row count takes (that of the nearest probe at or above it), timed once per weight shape and
    machine and kept under $CB_CACHE (~10 s for SmolLM2's shapes on a 2-core Zen 3, most of it the LM head)."""

    def __init__(self, ways: dict[int, str]):
        self.ways = ways
        self._by_rows = [ways[p] for p in PROBES]

    def way(self, n: int) -> str:
        return self._by_rows[min(bisect.bisect_left(PROBES, n), len(PROBES) - 1)]

    @classmethod
    def measure(cls, out_features: int, in_features: int) -> "Plan":
        # A wider weight is timed on its first MEASURED_OUT rows: beyond any cache, a product's cost per output
        # row is flat, so the ranking holds, and Gemma 3's 262k-row LM head is timed in 3 s rather than 43.
        weight = torch.randn(min(out_features, MEASURED_OUT), in_features)
        w = types.SimpleNamespace(**dict(zip(("weight", "packed", "onednn"),
                                             _layouts(weight, {"tile"} | ({"onednn"} if onednn() else set())))))
        timed = {}
        for n in PROBES:
            rows = torch.randn(n, in_features)
            candidates = ["linear", "transposed"] + (["tile"] if n <= TILE else []) + (["onednn"] if onednn() else [])
            timed[n] = {way: _fastest(lambda: _product(way, rows, w)) for way in candidates}
        return cls(_choose(timed))


def _choose(timed: dict[int, dict[str, float]]) -> dict[int, str]:
    """Each row count's way from its timings. A second layout costs the weight's memory again, so it is taken only
    where it saves 10% summed over the row counts (each counted relative to its fastest way): a plan reads one
    layout, oneDNN's or the plain one, unless mixing them is clearly faster. Within a layout a way must beat the
    layout's first by 10% at its row count (a clear win, not noise)."""
    layouts = [("onednn",)] if all("onednn" in t for t in timed.values()) else []
    layouts.append(("linear", "transposed", "tile"))

    def pick(t: dict[str, float], ways) -> str:
        first = next(w for w in ways if w in t)
        best = min((w for w in ways if w in t), key=t.get)
        return best if t[best] < 0.9 * t[first] else first

    def cost(ways) -> float:
        return sum(t[pick(t, ways)] / min(t.values()) for t in timed.values())

    alone = min(layouts, key=cost)
    both = layouts[0] + layouts[-1]
    ways = both if len(layouts) > 1 and cost(both) < 0.9 * cost(alone) else alone
    return {n: pick(t, ways) for n, t in timed.items()}


def _fastest(call) -> float:
    """The best of ~20 ms of timings (3 to 50 of them): at one row a product takes tens of microseconds, where one
    interruption decides a ranking; the LM head's at 512 rows, 100 ms."""
    start = time.perf_counter()
    call()
    repeats = max(3, min(50, int(0.02 / max(time.perf_counter() - start, 1e-6))))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def plan_for(out_features: int, in_features: int) -> Plan:
    key = f"{min(out_features, MEASURED_OUT)}x{in_features}"
    if key not in _plans:
        path = _plan_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        # One process measures while the others wait for its file: tensor-parallel ranks load the same shapes at
        # once, and timings taken on cores they share would be noise.
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            saved = json.loads(path.read_text()) if path.exists() else {}
            if key not in saved:
                saved[key] = Plan.measure(out_features, in_features).ways
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(saved))
                os.replace(tmp, path)
        _plans[key] = Plan({int(n): way for n, way in saved[key].items()})
    return _plans[key]


_plans: dict[str, Plan] = {}


def _plan_file() -> Path:
    """One file per machine, torch and thread count: the timings hold for nothing else."""
    machine = " ".join([platform.processor(), platform.machine(), *sorted(cpu.flags()), torch.__version__,
                        str(torch.get_num_threads()), ",".join(map(str, PROBES)), "stored transposed",
                        f"onednn {ONEDNN_ROWS}"])
    name = hashlib.sha256(machine.encode()).hexdigest()[:16]
    return cpu.cache_dir("linears") / f"plans-{name}.json"


def onednn() -> bool:
    return torch.backends.mkldnn.is_available()


def tunes_f32() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """What a quantized GEMM takes its activations in: an fp32 model's enter torch's int8/int4 CPU GEMMs in bf16,
    whose fast paths are bf16-only (fp32 activations measured 10-50x slower: 64 rows x 576 -> 3072, int8 113 ms
    against 3.4 ms, even on a CPU without bf16 arithmetic)."""
    return torch.bfloat16 if weight.device.type == "cpu" and weight.dtype == torch.float32 else weight.dtype


class _WeightOnly(nn.Module):
    """A quantized weight's GEMM takes 2-D activations in `compute`: the leading dimensions are flattened around
    it, and its output returns in the model's dtype."""
    compute: torch.dtype

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x.reshape(-1, x.shape[-1]).to(self.compute)).to(x.dtype).view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


class Int8(_WeightOnly):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scales = (w.abs().amax(1) / 127).clamp(min=1e-8)
        self.compute = _compute_dtype(linear.weight)
        self.register_buffer("weight", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(self.compute))
        self.bias = linear.bias

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scales)


class Int4(_WeightOnly):
    """Asymmetric 4-bit groups: w ≈ (q - 8) * scale + zero, q in 0..15, the min and max of each group exact."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        n, k = w.shape
        groups = w.view(n, k // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = ((high - low) / 15).clamp(min=1e-8)
        q = torch.round((groups - low) / scale).clamp(0, 15).to(torch.int32).view(n, k)
        zero = low + 8 * scale
        self.compute = _compute_dtype(linear.weight)
        self.register_buffer("weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        self.register_buffer("scales_and_zeros", torch.stack([scale.view(n, -1), zero.view(n, -1)], -1)
                             .transpose(0, 1).contiguous().to(self.compute))
        self.bias = linear.bias

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.weight, INT4_GROUP, self.scales_and_zeros)


def packs_bf16() -> bool:
    """oneDNN can lay bf16 weights out on this CPU (it refuses without AVX-512 or AVX-NE-CONVERT)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def check(quantize: Optional[str], device: torch.device) -> None:
    if quantize not in (None, *MODES):
        raise ValueError(f"--quantize {quantize}: the modes are {', '.join(MODES)}")
    if quantize == "int4" and device.type != "cpu":
        raise ValueError("--quantize int4 has a CPU kernel only; on a GPU use int8 or no --quantize")


def kernel_for(linear: nn.Linear, quantize: Optional[str], device: torch.device, head: bool) -> Optional[nn.Module]:
    """The module to put in the linear's place, or None to keep it. head: the LM head."""
    if quantize == "int8" or (quantize == "int4" and head):
        return Int8(linear)
    if quantize == "int4" and linear.in_features % INT4_GROUP == 0:
        return Int4(linear)
    if device.type == "cpu" and linear.weight.dtype == torch.bfloat16 and packs_bf16():
        return Packed(linear)
    if device.type == "cpu" and linear.weight.dtype == torch.float32 and tunes_f32():
        return Tuned(linear, plan_for(linear.out_features, linear.in_features))
    return None


def convert(model: nn.Module, quantize: Optional[str], device: torch.device) -> nn.Module:
    """Swaps every nn.Linear of the (already sharded, already placed) model in place; `check` first."""
    head = model.get_output_embeddings()
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                kernel = kernel_for(child, quantize, device, child is head)
                if kernel is not None:
                    setattr(module, name, kernel)
    return model
