"""Triton kernels as ``torch.library`` custom ops (namespace ``hf_hybrid``), for torch.compile.

Why: ``torch.compile(model, fullgraph=True)`` must not trace into a Triton launch or into an
``autograd.Function`` full of host-side launch logic (Inductor then recompiles the user kernels
itself, and that failed on sm_90). A custom op is one opaque node: Dynamo records it, the fake
("meta") function gives its output shapes without running it, and the autograd formula is a second
custom op (the backward kernels), so the compiled backward graph holds it as one node too.

How to expose a kernel (the pattern every op in kernels/ follows; see kernels/output_gate/__init__.py
for the smallest complete example):

1. A forward op ``@kernel_op("<op>_fwd")`` with annotated arguments (Tensor, Optional[Tensor],
   int, float, bool, str) returning a Tensor or a tuple of Tensors. It returns the result plus
   whatever the backward needs that is not an input (a softmax's log-sum-exp, stored states).
   Outputs must be fresh tensors, never an input or a view of one. An output that exists only
   sometimes is returned as :func:`placeholder` (0 elements; custom ops cannot return None).
   Import Triton modules inside the body: the op is defined at import time, the kernel runs later.
2. ``@<fwd>.register_fake``: the same outputs as empty tensors (shapes, dtypes and strides of the
   real ones; contiguous unless the kernel returns otherwise). It must not read data.
3. A backward op ``@kernel_op("<op>_bwd")`` taking the saved tensors and the output gradients and
   returning one gradient per differentiable input (placeholders where an input is absent), with
   its own fake (:func:`fake_like` of the inputs).
4. ``<fwd>.register_autograd(backward, setup_context=setup)``: ``setup(ctx, inputs, output)`` saves
   tensors with ``ctx.save_for_backward`` and plain values as attributes; ``backward(ctx, *grads)``
   calls the backward op and returns one entry per forward input (None for non-tensors).
5. Test it with ``torch.library.opcheck`` (tests/kernels/test_custom_ops.py) on CPU in Triton's
   interpreter (``TRITON_INTERPRET=1``).

Existing ``autograd.Function`` classes keep their launch code: :class:`KernelContext` stands in for
autograd's ctx so their ``forward`` / ``backward`` static methods can be the bodies of the ops.

Eager calls skip the dispatcher (``EagerKernelOp``, hf_hybrid/_compat/torch_custom_ops.py): outside torch.compile and tracing, an op
runs its body directly, through a plain ``autograd.Function`` built from the same setup / backward
when gradients are needed. Through ``torch.library`` each call pays the dispatcher, default
filling and the output-aliasing check on the host, enough to make an eager training step wait on
the host (`python -m benchmarks.host_time MODEL`).
"""
from __future__ import annotations

import inspect
from typing import Callable, Iterable

import torch
from torch._library.custom_ops import CustomOpDef

from .._compat.torch_custom_ops import with_eager_fast_path

NAMESPACE = "hf_hybrid"


def kernel_op(name: str, *, mutates_args: Iterable[str] = ()) -> Callable:
    """Decorator: ``torch.library.custom_op("hf_hybrid::<name>")`` for every device (the same body
    runs the Triton kernel on CUDA and in Triton's CPU interpreter). ``mutates_args`` names the
    arguments the kernel writes in place (a cache's buffers); everything else must stay untouched."""
    register = torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=tuple(mutates_args))

    def decorate(fn: Callable) -> CustomOpDef:
        return with_eager_fast_path(register(fn), len(inspect.signature(fn).parameters))

    return decorate


def placeholder(like: torch.Tensor) -> torch.Tensor:
    """A 0-element tensor standing for an absent optional output or gradient (custom ops return
    tensors only); the op's autograd glue turns it back into None from a flag, never from its size."""
    return like.new_empty(0)


def fake_like(*tensors: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """Fake gradients: one contiguous empty tensor per input (a placeholder for absent ones)."""
    first = next(t for t in tensors if t is not None)
    return tuple(placeholder(first) if t is None else torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors)


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd will differentiate through any of these tensors from here."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def optional(t: torch.Tensor, present: bool) -> torch.Tensor | None:
    """A placeholder output back to None (``present`` is the flag the op was called with)."""
    return t if present else None


class KernelContext:
    """Stands in for autograd's ``ctx`` when an ``autograd.Function``'s static ``forward`` or
    ``backward`` runs inside a custom op: records ``save_for_backward`` and attributes in the
    forward; takes the saved tensors and attributes as arguments for the backward."""

    def __init__(self, saved_tensors: tuple = (), needs_input_grad: tuple = (), **attributes):
        self.saved_tensors = tuple(saved_tensors)
        self.needs_input_grad = tuple(needs_input_grad)
        self.__dict__.update(attributes)

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors) -> None:  # autograd bookkeeping: nothing to do here
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass
