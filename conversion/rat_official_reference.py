"""A float64 restatement of the RAT and RAT+ authors' language models, read from their state dicts.

It states what the official forward computes (notes/official_code_facts.md), independently of
hf-hybrid's layers, so a conversion can be checked against it:

    x = wte[ids]
    per layer:  x = x + out_proj(mixer(RMSNorm(x)))             (the mixer's own pre-norm and residual)
                x = x + fc2(act(fc1(RMSNorm(x))))               (GELU, 4 x d_model, no bias in the presets)
    logits = head(RMSNorm(x))                                   (head = wte when tied); every eps 1e-6

RAT+ mixer: in_proj rows [o | q | k | v | g]; g = sigmoid(g); k~, v~ = full-sequence recurrence
h_t = g_t h_{t-1} + (1 - g_t) x_t; q and k~ rotated by the token position; attention with the
official mask (key j visible to query i iff j <= i and ((j + 1) % D == 0 or i - j <= W or j < I);
dense causal for D = 1); out = attention * sigmoid(o).
RAT mixer: in_proj rows [z | v | g | q | k], q/k of ``ngroups`` groups (head h reads group
h % ngroups); g = sigmoid(g + gate_bias); recurrence restarting every chunk of L tokens; q and k~
rotated by the chunk index t // L; query t attends to the chunk-end keys of the chunks before its own
and to its own k~_t, one softmax; out = sigmoid(z) * attention.
Scale d_head^-0.5; RoPE tables in float32 as the official code builds them. Where the official
forward rounds to bfloat16 (the recurrent states), this restatement keeps float64: it states the
math, the rounding belongs to the dtype a model runs in. Sequences need not fill whole chunks.
"""
from __future__ import annotations

import torch
from torch.nn import functional as F

from .rat_official_format import OFFICIAL_NORM_EPS, RAT_PLUS, OfficialSpec

_ACT = {"gelu": F.gelu, "fastgelu": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu, "silu": F.silu}


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + OFFICIAL_NORM_EPS) * weight


def _rope_tables(positions: torch.Tensor, d_head: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, d_head, 2).float() / d_head))
    freqs = positions.float()[:, None] * inv_freq
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos().double(), angles.sin().double()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, d_head] (rotate-half RoPE)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def _scan(gate: torch.Tensor, x: torch.Tensor, restart_every: int | None = None) -> torch.Tensor:
    """h_t = g_t h_{t-1} + (1 - g_t) x_t over dim 1 of [B, T, C]; h restarts at multiples of restart_every."""
    out, state = torch.empty_like(x), torch.zeros_like(x[:, 0])
    for t in range(x.shape[1]):
        if restart_every and t % restart_every == 0:
            state = torch.zeros_like(state)
        state = gate[:, t] * state + (1 - gate[:, t]) * x[:, t]
        out[:, t] = state
    return out


def official_mask(seq: int, dilation: int, local: int, initial: int) -> torch.Tensor:
    """[T, T] bool: the official inference mask (dense causal for dilation 1)."""
    i = torch.arange(seq)[:, None]
    j = torch.arange(seq)[None, :]
    visible = ((j + 1) % dilation == 0) | (i - j <= local) | (j < initial)
    return (j <= i) & visible


def _heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    batch, seq, width = x.shape
    return x.view(batch, seq, num_heads, width // num_heads).transpose(1, 2)  # [B, H, T, d]


def _rat_plus_mixer(h, W, spec: OfficialSpec, pattern: tuple[int, int, int]):
    d, heads = spec.d_model, spec.d_model // spec.d_head
    o, q, k, v, *g = h.matmul(W["in_proj"].T).split(d, dim=-1)
    if spec.apply_re:
        gate = torch.sigmoid(g[0])
        k, v = _scan(gate, k), _scan(gate, v)
    q, k, v = _heads(q, heads), _heads(k, heads), _heads(v, heads)
    cos, sin = _rope_tables(torch.arange(h.shape[1]), spec.d_head, spec.rope_base)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    scores = q.matmul(k.transpose(-1, -2)) * spec.d_head**-0.5
    scores = scores.masked_fill(~official_mask(h.shape[1], *pattern), float("-inf"))
    out = scores.softmax(-1).matmul(v).transpose(1, 2).reshape(h.shape)
    return (out * torch.sigmoid(o)).matmul(W["out_proj"].T)


def _rat_mixer(h, W, spec: OfficialSpec):
    d, heads, L, groups = spec.d_model, spec.d_model // spec.d_head, spec.chunk_size, spec.ngroups
    z, v, g, q, k = h.matmul(W["in_proj"].T).split([d, d, d, groups * spec.d_head, groups * spec.d_head], dim=-1)
    gate = torch.sigmoid(g + W["gate_bias"])
    q, k = q.repeat(1, 1, heads // groups), k.repeat(1, 1, heads // groups)  # head h reads group h % groups
    k, v = _scan(gate, k, L), _scan(gate, v, L)
    q, k, v = _heads(q, heads), _heads(k, heads), _heads(v, heads)
    seq = h.shape[1]
    chunk = torch.arange(seq) // L
    cos, sin = _rope_tables(chunk, spec.d_head, spec.rope_base)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    ends = torch.tensor(list(range(L - 1, seq, L)), dtype=torch.long)  # the last token of every complete chunk
    scale = spec.d_head**-0.5
    inter = q.matmul(k[:, :, ends].transpose(-1, -2)) * scale  # [B, H, T, chunks]
    inter = inter.masked_fill(~(chunk[:, None] > torch.arange(len(ends))[None, :]), float("-inf"))
    own = (q * k).sum(-1, keepdim=True) * scale
    weights = torch.cat([inter, own], dim=-1).softmax(-1)
    out = weights[..., :-1].matmul(v[:, :, ends]) + weights[..., -1:] * v
    out = out.transpose(1, 2).reshape(h.shape)
    return (torch.sigmoid(z) * out).matmul(W["out_proj"].T)


class _Float64View(dict):
    """The state dict read one tensor at a time in float64 (a 7B checkpoint is never copied whole),
    each first rounded to ``round_to`` when given (the dtype a conversion stored the weights in)."""

    round_to: torch.dtype | None = None

    def __getitem__(self, key):
        value = super().__getitem__(key)
        return (value.to(self.round_to) if self.round_to is not None else value).double()

    def raw(self, key):
        return super().__getitem__(key)

    def get(self, key, default=None):
        return self[key] if key in self else default


def official_logits_float64(state: dict[str, torch.Tensor], spec: OfficialSpec, ids: torch.Tensor,
                            pattern: tuple[int, int, int] | list[tuple[int, int, int]] = (1, 0, 0),
                            weights_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Logits [B, T, V] in float64 of the official model. ``pattern`` (RAT+): the (dilation,
    local_size, initial_size) mask, one for all layers or one per layer; (1, 0, 0) is dense.
    ``weights_dtype``: read the weights rounded to this dtype first (e.g. as converted to bfloat16)."""
    W = _Float64View({key.replace("_orig_mod.", ""): value for key, value in state.items()})
    W.round_to = weights_dtype
    patterns = pattern if isinstance(pattern, list) else [tuple(pattern)] * spec.num_layers
    x = W["embedding.wte.weight"][ids] if weights_dtype is None else W.raw("embedding.wte.weight")[ids].to(weights_dtype).double()
    for i in range(spec.num_layers):
        p = f"backbone.layers.{i}."
        mixer = {"in_proj": W[p + "seq_layer.in_proj.weight"], "out_proj": W[p + "seq_layer.out_proj.weight"],
                 "gate_bias": W.get(p + "seq_layer.gate_bias")}
        fgate = W.get(p + "seq_layer.fgate_proj.weight")  # older RAT+ files keep the gate rows apart
        if fgate is not None and mixer["in_proj"].shape[0] == 4 * spec.d_model:
            mixer["in_proj"] = torch.cat([mixer["in_proj"], fgate])
        h = _rms_norm(x, W[p + "seq_layer.input_norm.weight"])
        x = x + (_rat_plus_mixer(h, mixer, spec, patterns[i]) if spec.kind == RAT_PLUS else _rat_mixer(h, mixer, spec))
        h = _rms_norm(x, W[p + "hidden_layer.ln.weight"])
        up = h.matmul(W[p + "hidden_layer.fc1.weight"].T)
        if spec.ffn_bias:
            up = up + W[p + "hidden_layer.fc1.bias"]
        if spec.act_fn == "swiglu":
            value, gate = up.chunk(2, dim=-1)
            act = F.silu(gate) * value
        else:
            act = _ACT[spec.act_fn](up)
        down = act.matmul(W[p + "hidden_layer.fc2.weight"].T)
        x = x + (down + W[p + "hidden_layer.fc2.bias"] if spec.ffn_bias else down)
    x = _rms_norm(x, W["backbone.ln.weight"])
    head = W["embedding.wte.weight"] if spec.tie_embedding else W["head.lm_head.weight"]
    return x.matmul(head.T)
