"""How the shard multiplies by a weight: at load, every nn.Linear of the model (tensor-parallel ones included) is
swapped for the fastest kernel this device has for the weight's mode.

- **bf16 on CPU** (`Packed`): oneDNN's own kernel with the weight laid out for it once, at load
  (`mkldnn._reorder_linear_weight`). `F.linear` hands oneDNN a plain weight, which it reorders on every call:
  the same kernel with the same sums (bit-identical logits), 1.3-2x faster for decode-sized batches. oneDNN
  packs bf16 only on CPUs with AVX-512 (or AVX-NE-CONVERT); elsewhere bf16 stays on `F.linear`.
  float32 stays on `F.linear` (MKL), as transformers runs it: it is the exact mode the golden tests compare.
- **`--quantize int8`** (`Int8`): one scale per output channel, torch's int8-weight GEMM. Half the bytes of bf16.
- **`--quantize int4`** (`Int4`): groups of 32 input channels share a scale and a zero point (the layout of
  llama.cpp's Q4_1), torch's int4-weight GEMM for CPU. A quarter of the bytes of bf16; from ~8 requests at a
  time its GEMM is slower than bf16's. The LM head stays int8, as llama.cpp keeps its output matrix at 6 or 8
  bits: SmolLM2's perplexity on bench/data/quality.txt is 10.05 so, 10.69 with an int4 head, 10.06 in bf16.

Activations are never quantized, so a request's tokens do not depend on what shares its batch.
"""
from typing import Optional

import torch
from torch import nn

MODES = ("int8", "int4")
INT4_GROUP = 32


class Packed(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


class _WeightOnly(nn.Module):
    """A quantized weight's GEMM takes 2-D activations: the leading dimensions are flattened around it."""

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


class Int8(_WeightOnly):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scales = (w.abs().amax(1) / 127).clamp(min=1e-8)
        self.register_buffer("weight", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(linear.weight.dtype))
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
        self.register_buffer("weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        self.register_buffer("scales_and_zeros", torch.stack([scale.view(n, -1), zero.view(n, -1)], -1)
                             .transpose(0, 1).contiguous().to(linear.weight.dtype))
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
