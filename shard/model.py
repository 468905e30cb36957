"""Loads a transformers causal LM with its attention routed to the paged cache, sharded for this rank."""
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

from shard import attention
from shard.tensor_parallel import shard_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: object
    num_layers: int
    kv_heads: int      # on this rank
    head_dim: int
    sliding_window: int  # 0 when no layer slides
    sliding: list[bool]  # per layer: attends within sliding_window (its KV lives in the window pool)


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def load(model_dir: str, dtype: str, device: torch.device, rank: int, world: int) -> LoadedModel:
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
    return LoadedModel(model, cfg, cfg.num_hidden_layers, kv_heads, head_dim,
                       cfg.sliding_window if any(sliding) else 0, sliding)
