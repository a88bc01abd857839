"""Eager calls of this package's custom ops without torch's dispatcher: the op object's class is
swapped for :class:`EagerKernelOp` (kernels/_custom_ops.py's ``kernel_op`` does it for every op).

Why: through ``torch.library`` each call cost ~0.4 ms of host time (the dispatcher, default filling
and the output-aliasing check): 18 of the ~64 ms a RAT training step at T=8K spent enqueueing work
on the H100 (cProfile), while the GPU needed ~49 ms. Outside torch.compile and tracing an op runs its
body directly, through a plain ``autograd.Function`` built from the same setup / backward when
gradients are needed; everything else takes the registered op.

Patch of torch's behaviour (DESIGN.md, "Patches of other libraries"): it subclasses the private
``torch._library.custom_ops.CustomOpDef`` and reads its ``_init_fn`` and ``_name``. Checked against
torch TORCH_VERSIONS; on any other version, or where those attributes are missing, the op stays
torch's own object and every call goes through the dispatcher.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch._library.custom_ops import CustomOpDef
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import within

TORCH_VERSIONS = ((2, 11), (2, 13))  # first and last (major, minor) checked, inclusive


def torch_checked(version: str | None = None) -> bool:
    """Whether this torch (or ``version``) is one the eager path was checked against."""
    return within(torch.__version__ if version is None else version, TORCH_VERSIONS)


def with_eager_fast_path(op: CustomOpDef, arity: int) -> CustomOpDef:
    """``op`` (just registered) with eager calls of ``arity`` positional arguments running its body
    directly; ``op`` unchanged on a torch this was not checked against."""
    if not (torch_checked() and type(op) is CustomOpDef and hasattr(op, "_init_fn") and hasattr(op, "_name")):
        return op
    op.__class__ = EagerKernelOp  # the same object, plus the eager fast path
    op._eager_arity = arity
    op._eager_function = None
    return op


def _traced(args: tuple) -> bool:
    """Whether a call must go through the dispatcher: torch.compile, a dispatch mode (fake tensors,
    make_fx, opcheck's checks), functorch transforms, or tensor subclasses other than Parameter."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return True
    if torch._C._are_functorch_transforms_active():
        return True
    return any(isinstance(a, torch.Tensor) and type(a) not in (torch.Tensor, torch.nn.Parameter) for a in args)


class EagerKernelOp(CustomOpDef):
    """A kernel_op whose eager calls run the body directly (see the module docstring): the same
    function, setup and backward as the registered op, without the dispatcher's per-call cost.
    Calls with keywords, missing defaults or under tracing take the registered op."""

    def __call__(self, *args, **kwargs):
        if kwargs or len(args) != self._eager_arity or _traced(args):
            return super().__call__(*args, **kwargs)
        if self._eager_function is not None and torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args
        ):
            return self._eager_function.apply(*args)
        return self._init_fn(*args)

    def register_autograd(self, backward: Callable, /, *, setup_context: Callable | None = None) -> None:
        super().register_autograd(backward, setup_context=setup_context)
        body = self._init_fn

        def forward(ctx, *args):
            output = body(*args)
            if setup_context is not None:
                setup_context(ctx, args, output)
            return output

        self._eager_function = type(
            f"Eager_{self._name}", (torch.autograd.Function,),
            {"forward": staticmethod(forward), "backward": staticmethod(backward)},
        )
