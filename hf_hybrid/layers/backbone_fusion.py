"""Fused kernels for the backbone every architecture shares: the LM head with its loss and RMSNorm
(this package's kernels), SwiGLU (Liger Kernel, extra ``[fast]``).

In eager PyTorch an RMSNorm is six kernels, SwiGLU's product two, and the loss materialises the
float32 logits of the whole sequence (T x 32K x 4 bytes: 4 GiB at T = 32K, again for the gradient).
The LM head and its cross-entropy run chunk by chunk in kernels/linear_cross_entropy (no [T, vocab]
logits, no host synchronisation); the norm is one kernel each way (kernels/residual_norm, launched
through the compiled launcher, with less host time per call than Liger's RMSNorm: an 8K training
step is issued about as fast as the GPU runs it); Liger (``pip install hf-hybrid[fast]`` or
``liger-kernel``) fuses SwiGLU into one Triton kernel. Together they take a long training step's
time and peak memory down by about a quarter and a half (`hf-hybrid bench --suites models --only
train`; docs/benchmarks/models.md).

When they apply: automatically on CUDA tensors, the loss wherever Triton imports, the norm from
FUSED_MIN_TOKENS tokens per call (training and prefill), SwiGLU there too when ``liger_kernel`` is
installed. They are off on the CPU, inside torch.compile (Inductor fuses these ops
itself), and when switched off with the environment variable ``HF_HYBRID_LIGER=0`` (read at import)
or ``set_backbone_fusion(False)`` (at run time, e.g. to measure before / after). Our PyTorch code is
the path in every other case and the reference the fused path is tested against.

Numerics: the RMSNorm kernel is our RMSNorm's math (normalise and scale in float32, round once);
SiLU(gate) * up is computed in float32 and rounded once (PyTorch rounds after the SiLU too); the
fused loss equals transformers' ForCausalLMLoss (see loss.py).
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util

import torch

from ..kernels._backend import triton_available
from ..kernels.residual_norm import rms_norm
from ..options import get as option

_enabled = option("HF_HYBRID_LIGER")
_allow_cpu = False
# The norm and SwiGLU kernels are used from this many tokens per call: a decode step (a few tokens)
# is launch-bound, and there Liger's Python-side launch costs more than the PyTorch ops (an eager
# Llama with Liger decodes slower than without), while training and prefill gain.
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


@functools.lru_cache(maxsize=None)
def liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def fused_decode_active() -> bool:
    """True inside generate()'s static decode step with fused_decode on: the fused norm kernels
    (the backbone's RMSNorm, the per-head ones) and Liger's SwiGLU apply there at any token count."""
    return _fused_decode and _static_decode_depth > 0


def fused_backbone_applies(x: torch.Tensor) -> bool:
    """True when Liger's SwiGLU kernel may run on ``x`` (see the module docstring):
    where the fused loss would, with Liger installed."""
    return fused_loss_applies(x) and liger_installed()


def fused_loss_applies(x: torch.Tensor) -> bool:
    """True when the LM head and its loss on ``x`` run as this package's chunked Triton kernel
    (kernels/linear_cross_entropy; loss.py): where the fused backbone would run, Liger or not."""
    # is_compiling() first: under torch.compile nothing after it is traced (find_spec is untraceable)
    return not torch.compiler.is_compiling() and _enabled and (x.is_cuda or _allow_cpu) and triton_available()


def fused_norm_applies(x: torch.Tensor) -> bool:
    """True when the RMSNorm on ``x`` [..., features] runs as kernels/residual_norm: where the
    fused loss would, from ``FUSED_MIN_TOKENS`` rows (training and prefill, not eager decode
    steps), or in the static decode step with fused_decode on."""
    if not fused_loss_applies(x):
        return False
    return x.numel() >= _min_tokens * x.shape[-1] or fused_decode_active()


def fused_layer_applies(x: torch.Tensor) -> bool:
    """As fused_backbone_applies, for the per-layer norm and SwiGLU on ``x`` [..., features]:
    also needs at least ``FUSED_MIN_TOKENS`` rows (training and prefill, not eager decode steps),
    or the static decode step with fused_decode on."""
    if not fused_backbone_applies(x):
        return False
    return x.numel() >= _min_tokens * x.shape[-1] or fused_decode_active()


@functools.lru_cache(maxsize=None)
def _ops():
    # In a try block: transformers' remote-code loader (checkpoints saved with their code) treats
    # every other import in this file as a hard requirement, and Liger is optional.
    try:
        from liger_kernel.ops import LigerSiLUMulFunction
    except ImportError as exc:
        raise ImportError(f"the fused SwiGLU needs liger-kernel: pip install 'hf-hybrid[fast]' ({exc})") from exc
    return LigerSiLUMulFunction


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension with a 1-D weight, one kernel each way (float32 math)."""
    return rms_norm(x, weight, eps, backend="triton")


def fused_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in one kernel (and one for the backward)."""
    return _ops().apply(gate, up)


