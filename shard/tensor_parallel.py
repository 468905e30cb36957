"""Splits a transformers decoder across ranks, Megatron style, in place.

Attention: q/k/v projections keep this rank's heads (column split), o_proj keeps the matching input columns
(row split) and all-reduces its output. When there are fewer KV heads than ranks, each rank keeps the KV
heads its query heads use (replication). MLP: gate/up column split, down row split + all-reduce.
Embeddings, norms and the LM head stay whole on every rank.
"""
import torch.distributed as dist
from torch import nn

from shard.split_rule import SplitWidths, check_shard_count


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard @ W_shard^T) + b: the partial products of every rank summed. The product is a plain
    nn.Linear, so that linears.py swaps its kernel like any other."""

    def __init__(self, linear: nn.Linear, start: int, end: int):
        super().__init__()
        self.part = nn.Linear(end - start, linear.out_features, bias=False, dtype=linear.weight.dtype,
                              device=linear.weight.device)
        self.part.weight = nn.Parameter(linear.weight.data[:, start:end].clone(), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x):
        y = self.part(x)
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias


def _keep_rows(linear: nn.Linear, start: int, end: int) -> None:
    linear.weight = nn.Parameter(linear.weight.data[start:end].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[start:end].clone(), requires_grad=False)
    linear.out_features = end - start


def shard_attention(attn: nn.Module, num_heads: int, num_kv_heads: int, rank: int, world: int) -> int:
    """Keeps this rank's heads; returns the number of KV heads this rank holds."""
    d = attn.head_dim
    heads = num_heads // world
    group = num_heads // num_kv_heads
    kv_first = rank * heads // group
    kv_last = ((rank + 1) * heads - 1) // group
    local_kv = kv_last - kv_first + 1
    _keep_rows(attn.q_proj, rank * heads * d, (rank + 1) * heads * d)
    _keep_rows(attn.k_proj, kv_first * d, (kv_last + 1) * d)
    _keep_rows(attn.v_proj, kv_first * d, (kv_last + 1) * d)
    attn.o_proj = RowParallelLinear(attn.o_proj, rank * heads * d, (rank + 1) * heads * d)
    attn.num_key_value_groups = heads // local_kv
    return local_kv


def shard_mlp(mlp: nn.Module, intermediate: int, rank: int, world: int) -> None:
    part = intermediate // world
    start, end = rank * part, (rank + 1) * part
    _keep_rows(mlp.gate_proj, start, end)
    _keep_rows(mlp.up_proj, start, end)
    mlp.down_proj = RowParallelLinear(mlp.down_proj, start, end)


def shard_model(model: nn.Module, rank: int, world: int) -> int:
    """Shards every decoder layer; returns the KV heads per rank."""
    cfg = model.config
    heads, kv_heads, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    check_shard_count(SplitWidths(heads, kv_heads, inter), world, cfg.model_type)
    local_kv = kv_heads
    for layer in model.model.layers:
        local_kv = shard_attention(layer.self_attn, heads, kv_heads, rank, world)
        shard_mlp(layer.mlp, inter, rank, world)
    return local_kv

