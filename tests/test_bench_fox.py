"""The FoX suite's portable rows (hf_hybrid/bench/forgetting_attention.py): the Hopper kernels held
off by their dispatch predicates for a block, and put back after it."""
from __future__ import annotations

from hf_hybrid.bench.forgetting_attention import portable_kernels
from hf_hybrid.kernels.forgetting_attention import sdpa
from hf_hybrid.kernels.forgetting_attention import triton as fa


def test_portable_kernels_hold_the_hopper_predicates_off_and_restore_them():
    before = (fa.hopper_forward_applies, fa.hopper_backward_applies, sdpa.hopper_forward_applies)
    with portable_kernels(forward=False):
        assert fa.hopper_forward_applies is before[0] and sdpa.hopper_forward_applies is before[2]
        assert fa.hopper_backward_applies(None, None) is False
    with portable_kernels():
        assert fa.hopper_forward_applies(None, None) is False and sdpa.hopper_forward_applies(None, None) is False
        assert fa.hopper_backward_applies(None, None) is False
    assert (fa.hopper_forward_applies, fa.hopper_backward_applies, sdpa.hopper_forward_applies) == before
