"""Tensor helpers that more than one op needs (kept here so that no op imports another's module)."""
from __future__ import annotations

import torch


def expand_groups(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, T, G, D] -> [B, T, heads, D]; head h reads group h % G (RAT's q/k sharing)."""
    batch, seq, groups, dim = x.shape
    return x.unsqueeze(2).expand(batch, seq, heads // groups, groups, dim).reshape(batch, seq, heads, dim)


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` when its last dim is contiguous (what the Triton kernels index with unit stride), else a
    contiguous copy: strided views of the other dims go to the kernels as they are."""
    return t if t.stride(-1) == 1 else t.contiguous()


def leading_strides(x: torch.Tensor) -> tuple[int, int, int]:
    """Strides of the first three dims of a [batch, seq, heads, dim] tensor (dim contiguous):
    what the row-wise Triton kernels take to address any such view."""
    return x.stride(0), x.stride(1), x.stride(2)


_MULTIPROCESSORS: dict[int, int] = {}


def multiprocessors(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA device, read once per device (the property query is
    slow next to a kernel launch): what persistent grids and split-K plans size themselves by."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _MULTIPROCESSORS:
        _MULTIPROCESSORS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _MULTIPROCESSORS[index]
