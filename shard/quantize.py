"""`--quantize int8`: weight-only int8. Every nn.Linear keeps its weights as int8 with one scale per output
channel and multiplies through torch's int8-weight GEMM (`_weight_int8pack_mm`), activations staying in the
model's dtype. Half the bytes of bf16 to stream per token, so a step of a few requests (bound by memory
bandwidth on a CPU) runs up to twice as fast; large batches (bound by arithmetic) run slower than bf16.
Activations are never quantized, so a request's tokens do not depend on what shares its batch."""
import torch
from torch import nn


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scales = (w.abs().amax(1) / 127).clamp(min=1e-8)
        self.register_buffer("weight", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(linear.weight.dtype))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        y = torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scales).view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


def quantize_int8(model: nn.Module) -> nn.Module:
    """Swaps every nn.Linear of the model for an Int8Linear, in place."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear(child))
    return model
