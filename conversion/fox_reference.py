"""A float64 restatement of the source FoX forward passes, from their config and state dict alone.

It reads the official / FLA parameter names directly (no hf-hybrid model involved), so comparing a
converted model against it checks the conversion, not our model against itself. Naive O(T^2)
attention; meant for short parity checks.

Per block (both formats): h = x + Attn(RMSNorm(x)); out = h + SwiGLU(RMSNorm(h)). Attention:

    q = W_q x;  k~ = W_k x;  v~ = W_v x                         (per head, head_dim = hidden / heads)
    KV-shift (official): k = a k~_{t-1} + (1 - a) k~_t, a = sigmoid(W_s x) per head (k~_{-1} = 0)
    QK-norm: per-head RMSNorm, eps 1e-5;  RoPE (official, use_rope) after the norms
    log f = logsigmoid(W_f x + b_f) | logsigmoid(b) | 0;  c = cumsum(log f)
    o_i = sum_{j <= i} softmax_j(q_i . k_j / sqrt(d) + c_i - c_j) v_j
    output: W_o (RMSNorm_h(o) * sigmoid(W_g x))  with the norm / gate where configured
"""
from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from .fox_formats import OFFICIAL, QK_NORM_EPS, intermediate_size, source_format


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _head_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [B, T, H, D]; weight flat [H * D] or shared [D]."""
    heads, dim = x.shape[-2:]
    return _rms(x, weight.reshape(-1, dim) if weight.numel() == heads * dim else weight, eps)


def _rope(x: torch.Tensor, base: float) -> torch.Tensor:
    seq, dim = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq
    cos, sin = [torch.cat([f, f], -1)[None, :, None, :] for f in (angles.cos(), angles.sin())]
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _shift(h: torch.Tensor, k: torch.Tensor, shift_weight: torch.Tensor) -> torch.Tensor:
    alpha = torch.sigmoid(h @ shift_weight.T)[..., None]  # [B, T, H, 1]
    previous = torch.cat([torch.zeros_like(k[:, :1]), k[:, :-1]], dim=1)
    return alpha * previous + (1 - alpha) * k


def _attention(h: torch.Tensor, p, cfg: dict, fmt: str) -> torch.Tensor:
    batch, seq, hidden = h.shape
    heads = cfg["num_heads"]
    kv_heads = cfg.get("num_kv_heads") or heads
    dim = hidden // heads
    q = (h @ p("q_proj.weight").T).view(batch, seq, heads, dim)
    keys_values = []
    for name, use_shift in (("k", cfg.get("use_k_shift")), ("v", cfg.get("use_v_shift"))):
        if fmt == OFFICIAL and use_shift:
            x = (h @ p(f"{name}_proj.linear.weight").T).view(batch, seq, kv_heads, dim)
            x = _shift(h, x, p(f"{name}_proj.shift_proj.weight"))
        else:
            x = (h @ p(f"{name}_proj.weight").T).view(batch, seq, kv_heads, dim)
        keys_values.append(x)
    k, v = keys_values
    if cfg.get("qk_norm"):
        q, k = _head_rms(q, p("q_norm.weight"), QK_NORM_EPS), _head_rms(k, p("k_norm.weight"), QK_NORM_EPS)
    if fmt == OFFICIAL and cfg.get("use_rope"):
        q, k = _rope(q, cfg.get("rope_base", 500000.0)), _rope(k, cfg.get("rope_base", 500000.0))
    fgate = cfg.get("fgate_type", "full") if fmt == OFFICIAL else "full"
    if fgate == "full":
        log_f = F.logsigmoid(h @ p("fgate_proj.weight" if fmt == OFFICIAL else "f_proj.weight").T
                             + p("fgate_proj.bias" if fmt == OFFICIAL else "f_proj.bias"))
    elif fgate == "none":
        log_f = h.new_zeros(batch, seq, heads)
    else:
        log_f = F.logsigmoid(p("fgate_bias")).expand(batch, seq, heads)
    c = log_f.cumsum(1).transpose(1, 2)  # [B, H, T]
    group = heads // kv_heads
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(dim) + c[..., :, None] - c[..., None, :]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    o = torch.einsum("bhij,bjhd->bihd", weights, v)
    if fmt == OFFICIAL and cfg.get("use_output_norm"):
        o = _head_rms(o, p("output_norm.weight"), cfg.get("norm_eps", 1e-6))
    o = o.reshape(batch, seq, hidden)
    if cfg.get("use_output_gate"):
        o = o * torch.sigmoid(h @ p("ogate_proj.weight" if fmt == OFFICIAL else "g_proj.weight").T)
    return o @ p("o_proj.weight").T


def _mlp(h: torch.Tensor, p, cfg: dict, fmt: str) -> torch.Tensor:
    if fmt == OFFICIAL:
        gate, up = (h @ p("gate_proj.weight").T).split(intermediate_size(cfg), dim=-1)
    else:
        gate, up = h @ p("gate_proj.weight").T, h @ p("up_proj.weight").T
    return (F.silu(gate) * up) @ p("down_proj.weight").T


@torch.no_grad()
def source_logits_float64(config: dict, state: dict[str, torch.Tensor], input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, vocab] in float64 of the source checkpoint (``config`` = its config.json)."""
    fmt = source_format(config)
    eps = config.get("norm_eps", 1e-6)

    def tensor(name: str) -> torch.Tensor:
        return state[name].to(torch.float64)

    x = tensor("model.embeddings.weight")[input_ids]
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        h = _rms(x, tensor(prefix + "attn_norm.weight"), eps)
        x = x + _attention(h, lambda n: tensor(prefix + "attn." + n), config, fmt)
        h = _rms(x, tensor(prefix + "mlp_norm.weight"), eps)
        x = x + _mlp(h, lambda n: tensor(prefix + "mlp." + n), config, fmt)
    x = _rms(x, tensor("model.norm.weight"), eps)
    head = tensor("lm_head.weight") if "lm_head.weight" in state else tensor("model.embeddings.weight")
    return x @ head.T
