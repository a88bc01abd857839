"""CUDA's launch-grid limits, and the check the ops' grid functions are tested against.

A grid's axis 0 may hold up to 2**31 - 1 programs, axes 1 and 2 only 65,535 each. Every launch in
``hf_hybrid.kernels`` therefore puts the extents that grow with batch x tokens (or batch x heads)
on axis 0, folding them together where a kernel needs more than one, and keeps axes 1 and 2 for
extents bounded by the model's shape (heads, feature blocks) or by a fixed program budget.
"""
from __future__ import annotations

MAX_GRID_X = 2**31 - 1
MAX_GRID_YZ = 65_535


def check_grid(grid: tuple[int, ...], name: str = "grid") -> tuple[int, ...]:
    """Raise a ValueError naming the axis when ``grid`` passes CUDA's limits; return it otherwise."""
    if not 1 <= len(grid) <= 3:
        raise ValueError(f"{name}: a launch grid has 1 to 3 axes, got {grid}.")
    for axis, size in enumerate(grid):
        limit = MAX_GRID_X if axis == 0 else MAX_GRID_YZ
        if size > limit:
            raise ValueError(f"{name}: axis {axis} of {grid} has {size} programs, past CUDA's limit of {limit}.")
    return grid


def folded(inner: int, outer: int, *rest: int) -> tuple[int, ...]:
    """A grid whose axis 0 holds ``outer`` x ``inner`` programs, inner fastest (see
    :func:`split_program_id`), then the bounded axes ``rest``."""
    return (inner * outer, *rest)


try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the Triton kernels are not importable either
    pass
else:

    @triton.jit
    def split_program_id(inner):
        """(inner index, outer index) of a program on an axis 0 laid out by :func:`folded`."""
        pid = tl.program_id(0)
        return pid % inner, pid // inner
