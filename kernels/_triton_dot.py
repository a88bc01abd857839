"""A matrix product that Triton kernels of several ops share.

Triton's CPU interpreter (3.9) returns garbage for ``tl.dot`` on bfloat16 operands; there the
(already rounded) operands are multiplied in float32, which gives the products the GPU computes.
Compiled kernels never take that branch.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._backend import triton_interpreting

INTERPRET_UPCAST: tl.constexpr = tl.constexpr(triton_interpreting())


@triton.jit
def dot(a, b, acc, DOT_PREC: tl.constexpr):
    """acc + a @ b (acc may be None) at ``input_precision=DOT_PREC`` ("ieee" / "tf32")."""
    if INTERPRET_UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=DOT_PREC)
