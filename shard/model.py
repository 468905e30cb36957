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
    sliding_window: int


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
    has_sliding = "sliding_attention" in (getattr(cfg, "layer_types", None) or [])
    return LoadedModel(model, cfg, cfg.num_hidden_layers, kv_heads, head_dim,
                       (cfg.sliding_window or 0) if has_sliding else 0)
