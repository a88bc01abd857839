"""Fused kernels for the backbone every architecture shares, all of this package: the LM head with
its loss (kernels/linear_cross_entropy), RMSNorm (kernels/residual_norm) and SwiGLU's product
(kernels/output_gate, ``silu_gate``).

In eager PyTorch an RMSNorm is six kernels, SwiGLU's product two, and the loss materialises the
float32 logits of the whole sequence (T x 32K x 4 bytes: 4 GiB at T = 32K, again for the gradient).
The LM head and its cross-entropy run chunk by chunk (no [T, vocab] logits, no host
synchronisation); the norm and SwiGLU's product are one kernel each way. Every launch goes through
the compiled launcher (hf_hybrid/_compat/triton_launch.py): an 8K training step is issued about as
fast as the GPU runs it, so host time per call counts (Liger's RMSNorm and SwiGLU, used before,
took more; `python -m benchmarks.train_ab --compare backbone`). Together they take a long training
step's time and peak memory down by about a quarter and a half (`hf-hybrid bench --suites models
--only train`; docs/benchmarks/models.md).

When they apply: automatically on CUDA tensors wherever Triton imports, the loss always, the norm
and SwiGLU from FUSED_MIN_TOKENS tokens per call (training and prefill) and inside generate()'s
static decode step. They are off on the CPU, inside torch.compile (Inductor fuses these ops
itself), and when switched off with the environment variable ``HF_HYBRID_FUSED_BACKBONE=0`` (read
at import; its former name ``HF_HYBRID_LIGER`` is still read) or ``set_backbone_fusion(False)`` (at
run time, e.g. to measure before / after). Our PyTorch code is the path in every other case and the
reference the fused path is tested against.

Numerics: the RMSNorm kernel is our RMSNorm's math (normalise and scale in float32, round once);
SiLU(gate) * up is computed in float32 and rounded once (PyTorch rounds after the SiLU too); the
fused loss equals transformers' ForCausalLMLoss (see loss.py).
"""
from __future__ import annotations

import contextlib

import torch

from ..kernels._backend import triton_available
from ..kernels.output_gate import silu_gate
from ..kernels.residual_norm import rms_norm
from ..options import get as option

_enabled = option("HF_HYBRID_FUSED_BACKBONE")
_allow_cpu = False
# The norm and SwiGLU kernels are used from this many tokens per call. An eager decode step (a few
# tokens) keeps the PyTorch ops: chosen when these were Liger's kernels, whose Python-side launch
# cost more than the ops there (an eager Llama with Liger decodes slower than without).
FUSED_MIN_TOKENS = 1024
_min_tokens = FUSED_MIN_TOKENS
# Inside generate()'s static decode step (hf_hybrid/generation: captured in a CUDA graph on the GPU)
# there is no launch cost to amortise, only each kernel's own time: an RMSNorm as one kernel
# instead of six saves ~25 kernels per FoX Pro layer per token (and layers/fused_norms.py's
# per-head norm kernels apply there too; `python -m benchmarks.generation --unfused-decode`
# times it off). On by default; HF_HYBRID_FUSED_DECODE=0 or set_backbone_fusion(..., fused_decode=False)
# switches it off.
_fused_decode = option("HF_HYBRID_FUSED_DECODE")
_static_decode_depth = 0


def set_backbone_fusion(enabled: bool, *, allow_cpu: bool | None = None, min_tokens: int | None = None,
                        fused_decode: bool | None = None) -> None:
    """Switch the fused backbone kernels on (the default where they apply) or off for every model in the process.
    ``allow_cpu`` also sends CPU tensors to them (Triton's interpreter: for tests at tiny shapes);
    ``min_tokens``: the fewest tokens per call for which the norm and SwiGLU kernels are used
    (default FUSED_MIN_TOKENS); ``fused_decode``: use them in generate()'s static decode step too,
    whatever its token count. Options left as None keep their current value."""
    global _enabled, _allow_cpu, _min_tokens, _fused_decode
    _enabled = bool(enabled)
    if allow_cpu is not None:
        _allow_cpu = bool(allow_cpu)
    if min_tokens is not None:
        _min_tokens = int(min_tokens)
    if fused_decode is not None:
        _fused_decode = bool(fused_decode)


@contextlib.contextmanager
def backbone_fusion_settings(enabled: bool | None = None, *, fused_decode: bool | None = None):
    """set_backbone_fusion for a block (None: as it is), then the previous settings back: a
    benchmark's before / after rows."""
    previous = _enabled, _fused_decode
    set_backbone_fusion(previous[0] if enabled is None else enabled, fused_decode=fused_decode)
    try:
        yield
    finally:
        set_backbone_fusion(previous[0], fused_decode=previous[1])


@contextlib.contextmanager
def static_decode_step():
    """Marks generate()'s static decode step (hf_hybrid/generation/graph_decode.py runs its forward
    inside this), where the fused norm and SwiGLU kernels apply at any token count with fused_decode."""
    global _static_decode_depth
    _static_decode_depth += 1
    try:
        yield
    finally:
        _static_decode_depth -= 1


def backbone_fusion_enabled() -> bool:
    return _enabled


def fused_decode_active() -> bool:
    """True inside generate()'s static decode step with fused_decode on: the fused norm kernels
    (the backbone's RMSNorm, the per-head ones) and SwiGLU's apply there at any token count."""
    return _fused_decode and _static_decode_depth > 0


def fused_loss_applies(x: torch.Tensor) -> bool:
    """True when the LM head and its loss on ``x`` run as this package's chunked Triton kernel
    (kernels/linear_cross_entropy; loss.py)."""
    # is_compiling() first: under torch.compile nothing after it is traced (find_spec is untraceable)
    return not torch.compiler.is_compiling() and _enabled and (x.is_cuda or _allow_cpu) and triton_available()


def fused_layer_applies(x: torch.Tensor) -> bool:
    """True when the per-layer RMSNorm and SwiGLU on ``x`` [..., features] run as this package's
    kernels: where the fused loss would, from ``FUSED_MIN_TOKENS`` rows (training and prefill, not
    eager decode steps), or in the static decode step with fused_decode on."""
    if not fused_loss_applies(x):
        return False
    return x.numel() >= _min_tokens * x.shape[-1] or fused_decode_active()


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension with a 1-D weight, one kernel each way (float32 math)."""
    return rms_norm(x, weight, eps, backend="triton")


def fused_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in one kernel (and one for the backward)."""
    return silu_gate(gate, up, backend="triton")
