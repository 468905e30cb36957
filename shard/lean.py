"""A lean forward pass for Llama-family decoders (SmolLM2 among them): the same weights and the same arithmetic as
transformers' modules, written as one loop over the layers. transformers' path spends ~0.2 ms a layer in Python
(decorators, keyword plumbing, a causal mask we never read) and runs q/k/v and gate/up as five GEMMs; here they
are two (each pair of weights concatenated once at load), which at one request a step is most of the difference.

Chosen by model.py for plain Llama configs (no biases, SiLU, default RoPE scaling kinds that transformers'
rotary module computes); every other model runs transformers' own modules with attention routed to the cache.
"""
import torch
from torch import nn

from shard import attention
from shard.compiled import paged_attention
from shard.profiling import scope


def supports(model) -> bool:
    cfg = model.config
    return (cfg.model_type == "llama" and cfg.hidden_act == "silu" and not getattr(cfg, "attention_bias", False)
            and not getattr(cfg, "mlp_bias", False))


def _joined(*parts: nn.Linear) -> nn.Linear:
    """One linear whose output is the parts' outputs side by side."""
    weight = torch.cat([p.weight.detach() for p in parts])
    joined = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype, device=weight.device)
    joined.weight = nn.Parameter(weight, requires_grad=False)
    return joined


class Layer(nn.Module):
    def __init__(self, layer, index: int):
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.index = index
        self.qkv = _joined(attn.q_proj, attn.k_proj, attn.v_proj)
        self.widths = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
        self.o_proj = attn.o_proj  # row-parallel ones all-reduce inside (tensor_parallel.py)
        self.gate_up = _joined(mlp.gate_proj, mlp.up_proj)
        self.down_proj = mlp.down_proj
        self.norm_in, self.norm_post = layer.input_layernorm, layer.post_attention_layernorm
        self.head_dim, self.scaling = attn.head_dim, attn.scaling


class LeanLlama(nn.Module):
    """ids [T], positions [T], rows to keep [K] -> logits [K, vocab]; the layers' modules become `Layer`s (their
    linears joined), so linears.py then converts the joined ones."""

    def __init__(self, model):
        super().__init__()
        inner = model.model
        self.embed_tokens, self.rotary, self.norm, self.lm_head = inner.embed_tokens, inner.rotary_emb, inner.norm, model.lm_head
        self.layers = nn.ModuleList(Layer(layer, i) for i, layer in enumerate(inner.layers))
        self.config = model.config

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(ids)
        cos, sin = _cos_sin(self.rotary, h, positions)  # [T, D], broadcast over heads
        tokens = ids.shape[0]
        for layer in self.layers:
            x = _rms_norm(layer.norm_in, h)
            q, k, v = layer.qkv(x).split(layer.widths, dim=-1)
            q = q.view(tokens, -1, layer.head_dim).transpose(0, 1)
            k = k.view(tokens, -1, layer.head_dim).transpose(0, 1)
            v = v.view(tokens, -1, layer.head_dim).transpose(0, 1)
            with scope("module::rotary"):
                q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            h = h + layer.o_proj(_attend(layer.index, q, k, v, layer.scaling))
            x = _rms_norm(layer.norm_post, h)
            with scope("module::MLP"):
                gate, up = layer.gate_up(x).chunk(2, dim=-1)
                h = h + layer.down_proj(nn.functional.silu(gate) * up)
        return self.lm_head(_rms_norm(self.norm, h[keep]))


def _attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The paged attention; while torch.compile traces the forward (compiled.py), the same call as an op the
    graph does not look into."""
    if torch.compiler.is_compiling():
        return paged_attention(layer, q, k, v, scale)
    return attention.attend(layer, q, k, v, scale, None)


def _cos_sin(rotary, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' LlamaRotaryEmbedding.forward for one sequence, op for op, less its `autocast(enabled=False)`
    guard (nothing here runs under autocast): torch.compile's AOT autograd cache refuses graphs that enter autocast,
    and redoing that stage cost every start ~9 s of its compile. The rope kinds that update inv_freq as they go
    (dynamic, longrope) keep the module's own forward."""
    if getattr(rotary, "rope_type", "default") in ("dynamic", "longrope"):
        cos, sin = rotary(h, positions[None])
        return cos[0], sin[0]
    freqs = (rotary.inv_freq[None, :, None].float() @ positions[None, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * rotary.attention_scaling, emb.sin() * rotary.attention_scaling
    return cos.to(dtype=h.dtype)[0], sin.to(dtype=h.dtype)[0]


def _rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op (float32 inside)."""
    with scope("module::norms"):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        return norm.weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb on [heads, T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin

