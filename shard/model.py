"""Loads a transformers causal LM with its attention routed to the paged cache, sharded for this rank, its
linear layers on the device's fastest kernels, quantized when asked (linears.py)."""
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from transformers import AutoModelForCausalLM

from shard import attention, cpu
from shard import lean, linears
from shard.tensor_parallel import shard_model

# ids [T], positions [T], rows to keep [K] -> logits [K, vocab]
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NATIVE_BF16 = ("avx512_bf16", "amx_bf16")  # CPU flags of the instructions that compute in bf16


def resolve_dtype(name: str, device: torch.device) -> str:
    """`auto`: bfloat16 where the device computes in it (a GPU that has it; a CPU with AVX512-BF16 or AMX), else
    float32 on CPU (a CPU without them emulates bf16: a GEMM measured 4x slower than float32's) and float16 on
    a GPU without bf16."""
    if name != "auto":
        return name
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "bfloat16" if cpu.flags() & set(NATIVE_BF16) else "float32"


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: object
    num_layers: int
    kv_heads: int      # on this rank
    head_dim: int
    sliding_window: int  # 0 when no layer slides
    sliding: list[bool]  # per layer: attends within sliding_window (its KV lives in the window pool)
    forward: Forward
    dtype: torch.dtype  # of the KV cache
    quantize: Optional[str]  # None, "int8" or "int4" (linears.py)

    @property
    def dtype_name(self) -> str:
        """What `--dtype auto` became: float32, bfloat16 or float16."""
        return str(self.dtype).removeprefix("torch.")


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def forward_of(model) -> Forward:
    def forward(ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=ids[None], position_ids=positions[None], logits_to_keep=keep, use_cache=False)
        return out.logits[0]
    return forward


def load(model_dir: str, dtype: str, device: torch.device, rank: int, world: int,
         quantize: Optional[str] = None) -> LoadedModel:
    linears.check(quantize, device)
    dtype = resolve_dtype(dtype, device)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=DTYPES[dtype], attn_implementation=attention.NAME,
    )
    model.eval().requires_grad_(False)
    cfg = text_config(model.config)
    kv_heads = cfg.num_key_value_heads
    if world > 1:
        kv_heads = shard_model(model, rank, world)
    model.to(device)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    sliding = [t == "sliding_attention" and bool(cfg.sliding_window) for t in types]
    if lean.supports(model):
        model = lean.LeanLlama(model)
    linears.convert(model, quantize, device)
    forward = model if isinstance(model, lean.LeanLlama) else forward_of(model)
    return LoadedModel(model, cfg, cfg.num_hidden_layers, kv_heads, head_dim, cfg.sliding_window if any(sliding)
                       else 0, sliding, forward, DTYPES[dtype], quantize)
