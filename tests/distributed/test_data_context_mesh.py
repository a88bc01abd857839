"""Single-process checks of hf_hybrid/distributed/mesh.py and gradients.py: the buckets the
gradient all-reduces use (one dtype and device per bucket, the tensors in their order, none past
the byte limit unless one tensor alone is larger) and the meshes DataContextMesh.from_accelerate
refuses. (The reductions and meshes themselves run on gloo ranks: test_context_parallel_cpu.py,
test_train_context_parallel_cpu.py.)"""
from __future__ import annotations

import pytest
import torch

from hf_hybrid.distributed.gradients import gradient_buckets


def test_buckets_split_by_dtype_and_size():
    a, b, c = torch.zeros(10), torch.zeros(20), torch.zeros(30)  # 40, 80, 120 bytes of float32
    d, e = torch.zeros(4, dtype=torch.float64), torch.zeros(100)  # e: 400 bytes, over the limit alone
    buckets = gradient_buckets([a, d, b, c, e], bucket_bytes=128)
    ids = [[id(t) for t in bucket] for bucket in buckets]
    assert sorted(map(sorted, ids)) == sorted(map(sorted, [[id(a), id(b)], [id(c)], [id(e)], [id(d)]]))
    for bucket in buckets:
        assert len({t.dtype for t in bucket}) == 1
        assert len(bucket) == 1 or sum(t.numel() * t.element_size() for t in bucket) <= 128
    # every tensor exactly once
    assert sorted(id(t) for bucket in buckets for t in bucket) == sorted(map(id, [a, b, c, d, e]))


def test_bucket_size_must_be_positive():
    with pytest.raises(ValueError, match="bucket_bytes"):
        gradient_buckets([torch.zeros(1)], bucket_bytes=0)


class _Mesh:
    def __init__(self, names):
        self.mesh_dim_names = names


@pytest.mark.parametrize("names, message", [(("dp_shard",), "no 'cp' dimension"), (("dp_shard", "cp", "tp"), "tp_size=1")])
def test_accelerate_meshes_without_cp_or_with_tensor_parallelism_are_refused(names, message):
    from hf_hybrid.distributed import DataContextMesh

    with pytest.raises(ValueError, match=message):
        DataContextMesh.from_accelerate(_Mesh(names))


def test_an_accelerator_without_a_mesh_is_refused():
    from types import SimpleNamespace

    from hf_hybrid.distributed import DataContextMesh

    with pytest.raises(ValueError, match="ParallelismConfig"):
        DataContextMesh.from_accelerate(SimpleNamespace(torch_device_mesh=None))
