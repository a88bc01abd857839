"""Reference residual linear attention (RLA) and sliding-window attention (SWA) of RATTENTION.

RATTENTION's local layer (paper Sec. 3.1-3.2, Eq. 4; exact conventions from the official code,
see notes/rattention_official_facts.md) splits the causal past of query i at the window size w:

    SWA  sees keys j with 0 <= i - j <= w          (the token itself plus w to its left)
    RLA  sees keys j with      j <= i - w - 1       (exactly the tokens that left the window)

Residual linear attention, per batch row and head (no normaliser):

    phi(x)  = [softmax(x), softmax(-x)]  over head_dim   ("softmax", F = 2 D, the paper's choice)
            = [relu(x),    relu(-x)]                      ("relu",    F = 2 D)
            = x                                           ("identity", F = D)
    S_i     = S_0 + sum_{j <= i - w - 1} phi(k_j) v_j^T     [F, D]
    o_i     = phi(q_i)^T S_i
    S_final = S_0 + sum_{j <= T - 1 - w - 1} phi(k_j) v_j^T (what the next token, T, starts from
                                                          before folding key T - w - 1 into it)

phi and every sum are computed in float32 whatever the input dtype. ``w = -1`` is pure causal
linear attention (lag 0: the token itself is inside S_i); ``w = 0`` leaves the token to the SWA
and gives RLA everything before it; ``w >= T - 1`` makes the RLA term exactly phi(q_i)^T S_0.

q, k, v are the raw projections [batch, seq, heads, head_dim] (before RoPE and QK-norm, which
only the SWA branch applies). k and v may have fewer heads than q (grouped-query attention:
query head h reads key/value head h // (H / H_kv)); the state then has k's number of heads,
because phi(k) v^T is the same for every query head of a group.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ..window_attention.reference import window_attention_reference

FEATURE_MAPS = ("softmax", "relu", "identity")


def feature_dim(feature_map: str, head_dim: int) -> int:
    """F, the state's row count: 2 * head_dim for softmax / relu, head_dim for identity."""
    return head_dim if feature_map == "identity" else 2 * head_dim


def feature_map_fn(x: torch.Tensor, feature_map: str) -> torch.Tensor:
    """phi(x) over the last dimension, in float32."""
    x = x.float()
    if feature_map == "softmax":
        return torch.cat([torch.softmax(x, dim=-1), torch.softmax(-x, dim=-1)], dim=-1)
    if feature_map == "relu":
        return torch.cat([torch.relu(x), torch.relu(-x)], dim=-1)
    if feature_map == "identity":
        return x
    raise ValueError(f"feature_map must be one of {FEATURE_MAPS}, got {feature_map!r}.")


def _expand_heads(x: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """Repeat key/value heads (dim ``dim``) to ``heads`` query heads: head h reads h // group."""
    group = heads // x.shape[dim]
    return x if group == 1 else x.repeat_interleave(group, dim=dim)


def lagged_mask(seq: int, window_size: int, device=None) -> torch.Tensor:
    """[seq, seq] bool, True where query i reads key j through the RLA state: j <= i - w - 1."""
    i = torch.arange(seq, device=device)[:, None]
    j = torch.arange(seq, device=device)[None, :]
    return j <= i - (window_size + 1)


def residual_linear_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window_size: int,
    feature_map: str = "softmax",
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, with the explicit lagged mask. O(T^2) memory: the oracle for tests.

    q [B, T, H, D]; k, v [B, T, H_kv, D]; initial_state [B, H_kv, F, D] or None (zeros).
    Returns (o [B, T, H, D] in q's dtype, final_state [B, H_kv, F, D] float32).
    """
    batch, seq, heads, dim = q.shape
    kv_heads = k.shape[2]
    qf = feature_map_fn(q, feature_map)                              # [B, T, H, F]
    kf = feature_map_fn(k, feature_map)                              # [B, T, Hkv, F]
    vf = v.float()
    state0 = (
        torch.zeros(batch, kv_heads, qf.shape[-1], dim, device=q.device)
        if initial_state is None else initial_state.float()
    )
    scores = torch.einsum("bihf,bjhf->bhij", qf, _expand_heads(kf, heads, 2))
    scores = scores * lagged_mask(seq, window_size, q.device)
    o = torch.einsum("bhij,bjhd->bihd", scores, _expand_heads(vf, heads, 2))
    o = o + torch.einsum("bihf,bhfd->bihd", qf, _expand_heads(state0, heads, 1))
    folded = max(seq - (window_size + 1), 0)                          # keys j <= T - 1 - (w + 1)
    final = state0 + torch.einsum("bjhf,bjhd->bhfd", kf[:, :folded], vf[:, :folded])
    return o.to(q.dtype), final


# Chunks per activation-checkpointed segment of the chunked path: its backward keeps the raw
# inputs and one state per segment, and recomputes a segment's feature maps and tiles at a time.
CHUNKS_PER_SEGMENT = 16


def _rla_segment(q, k_shifted, v_shifted, state, num_zero_rows: int, feature_map: str, chunk_size: int):
    """One segment of :func:`residual_linear_attention_chunked`: rows p of q with the shifted keys
    and values k_{p - L}, v_{p - L} (their first ``num_zero_rows`` rows lie before the sequence and
    read as zero), from the entry ``state``. Returns (o float32, exit state)."""
    batch, seq, heads, dim = q.shape
    kv_heads = k_shifted.shape[2]
    qf = feature_map_fn(q, feature_map)
    features = qf.shape[-1]
    kf = feature_map_fn(k_shifted[:, num_zero_rows:], feature_map)
    vf = v_shifted[:, num_zero_rows:].float()
    if num_zero_rows:
        kf = torch.cat([kf.new_zeros(batch, num_zero_rows, kv_heads, features), kf], dim=1)
        vf = torch.cat([vf.new_zeros(batch, num_zero_rows, kv_heads, dim), vf], dim=1)
    group = heads // kv_heads
    outputs = []
    causal = torch.ones(chunk_size, chunk_size, device=q.device).tril()
    for start in range(0, seq, chunk_size):
        stop = min(start + chunk_size, seq)
        qc = qf[:, start:stop].reshape(batch, stop - start, kv_heads, group, features)
        kc, vc = kf[:, start:stop], vf[:, start:stop]
        inter = torch.einsum("btngf,bnfd->btngd", qc, state)
        scores = torch.einsum("btngf,bsnf->bngts", qc, kc) * causal[: stop - start, : stop - start]
        intra = torch.einsum("bngts,bsnd->btngd", scores, vc)
        outputs.append((inter + intra).reshape(batch, stop - start, heads, dim))
        state = state + torch.einsum("bsnf,bsnd->bnfd", kc, vc)
    return torch.cat(outputs, dim=1), state


def residual_linear_attention_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window_size: int,
    feature_map: str = "softmax",
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same function as :func:`residual_linear_attention_reference` in O(T * chunk) memory.

    The lag is a shift: with L = w + 1, RLA is causal linear attention over the key/value
    sequence delayed by L (k'_p = k_{p - L}, and v'_p = 0 for p < L, so those rows add nothing).
    Chunkwise form (paper Eq. 2-3) on the shifted sequence, chunk c = rows [cC, cC + C):
        o_c = phi(Q_c) S_c + (phi(Q_c) phi(K'_c)^T * causal) V'_c,   S_{c+1} = S_c + phi(K'_c)^T V'_c.
    Pure PyTorch and differentiable by autograd: the CPU fast path ("auto" off CUDA). With
    gradients, segments of CHUNKS_PER_SEGMENT chunks run under activation checkpointing (the
    backward keeps q, the shifted k, v and one state per segment: memory linear in T, small).
    """
    batch, seq, heads, dim = q.shape
    kv_heads = k.shape[2]
    lag = window_size + 1
    features = feature_dim(feature_map, dim)
    state = (
        torch.zeros(batch, kv_heads, features, dim, device=q.device)
        if initial_state is None else initial_state.float()
    )
    # Shifted key/value streams of length T (only keys 0 .. T - 1 - L are ever read); the first
    # `pad` rows are placeholders that each segment reads as zero.
    kept = max(seq - lag, 0)
    pad = seq - kept
    k_shifted = torch.cat([k.new_zeros(batch, pad, kv_heads, dim), k[:, :kept]], dim=1)
    v_shifted = torch.cat([v.new_zeros(batch, pad, kv_heads, dim), v[:, :kept]], dim=1)
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, initial_state))
    segment = chunk_size * CHUNKS_PER_SEGMENT
    outputs = []
    for start in range(0, seq, segment):
        stop = min(start + segment, seq)
        args = (q[:, start:stop], k_shifted[:, start:stop], v_shifted[:, start:stop], state,
                min(max(pad - start, 0), stop - start), feature_map, chunk_size)
        if grads:
            o, state = checkpoint(_rla_segment, *args, use_reentrant=False)
        else:
            o, state = _rla_segment(*args)
        outputs.append(o)
    o = torch.cat(outputs, dim=1) if outputs else q.new_zeros(batch, 0, heads, dim, dtype=torch.float32)
    return o.to(q.dtype), state


def residual_linear_attention_decode_reference(
    q: torch.Tensor,
    state: torch.Tensor,
    k_leaving: torch.Tensor | None = None,
    v_leaving: torch.Tensor | None = None,
    leaving_mask: torch.Tensor | None = None,
    feature_map: str = "softmax",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step (Eq. 4 read as a recurrence): fold the token leaving the window, read out.

        S <- S + phi(k_leaving) v_leaving^T      (rows where leaving_mask is True; all if None)
        o  = phi(q)^T S

    q [B, H, D]; state [B, H_s, F, D] float32 (H % H_s == 0); k_leaving / v_leaving [B, H_s, D]
    or None (nothing leaves yet: the window is not full). Returns (o [B, H, D] in q's dtype,
    the new state [B, H_s, F, D] float32). The state passed in is not modified.
    """
    batch, heads, dim = q.shape
    state_heads = state.shape[1]
    state = state.float()
    if k_leaving is not None:
        update = torch.einsum("bhf,bhd->bhfd", feature_map_fn(k_leaving, feature_map), v_leaving.float())
        if leaving_mask is not None:
            update = update * leaving_mask.to(update.dtype)[:, None, None, None]
        state = state + update
    qf = feature_map_fn(q, feature_map).view(batch, state_heads, heads // state_heads, -1)
    o = torch.einsum("bngf,bnfd->bngd", qf, state).reshape(batch, heads, dim)
    return o.to(q.dtype), state


def sliding_window_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window_size: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal softmax attention where query i sees keys j with 0 <= i - j <= window_size.

    q [B, T, H, D]; k, v [B, T, H_kv, D] (GQA: head h reads h // (H / H_kv)). Float32 softmax;
    returns q's dtype. ``window_size >= T - 1`` is plain causal attention.
    """
    return window_attention_reference(q, k, v, window_size + 1, scale)  # its window counts the token itself
