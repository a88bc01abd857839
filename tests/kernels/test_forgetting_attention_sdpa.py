"""Forgetting Attention's forward on the dense fused kernel with the forget bias as extra head
dimensions (kernels/forgetting_attention/sdpa.py) == the float64 reference, with grouped heads and
odd lengths; it refuses to be differentiated. CPU: PyTorch's flash CPU kernel + the Triton
interpreter for the augmentation kernel; `gpu`: cuDNN in bf16 at real lengths."""
from __future__ import annotations

import pytest
import torch

from hf_hybrid.kernels.forgetting_attention import forgetting_attention, forgetting_attention_reference

pytest.importorskip("hf_hybrid.kernels.forgetting_attention.sdpa_triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_inputs(b, t, hq, hkv, d, dtype, gate_mean=1.0, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(b, t, h, d, generator=g).to(DEVICE, dtype) for h in (hq, hkv, hkv))
    log_f = torch.nn.functional.logsigmoid(torch.randn(b, t, hq, generator=g) * 2 + gate_mean).to(DEVICE)
    return q, k, v, log_f


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("b,t,hq,hkv,gate_mean", [(1, 37, 2, 2, 1.0), (2, 20, 4, 2, -3.0), (1, 1, 2, 1, 0.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_forward_matches_reference(b, t, hq, hkv, gate_mean, dtype):
    q, k, v, log_f = make_inputs(b, t, hq, hkv, 64, dtype, gate_mean)
    with torch.no_grad():
        got = forgetting_attention(q, k, v, log_f, backend="sdpa")
    ref = forgetting_attention_reference(q.double(), k.double(), v.double(), log_f.double())
    assert got.shape == q.shape and got.dtype == dtype
    assert rel_err(got, ref) < (1e-5 if dtype == torch.float32 else 1e-2), f"{rel_err(got, ref):.2e}"


def test_sdpa_refuses_what_it_does_not_cover():
    q, k, v, log_f = make_inputs(1, 8, 2, 2, 64, torch.float32)
    with torch.no_grad(), pytest.raises(ValueError, match="window_size"):
        forgetting_attention(q, k, v, log_f, window_size=4, backend="sdpa")
    with torch.no_grad(), pytest.raises(ValueError, match="head_dim"):
        forgetting_attention(q[..., :16], k[..., :16], v[..., :16], log_f, backend="sdpa")
    with pytest.raises(ValueError, match="forward-only"):
        forgetting_attention(q.requires_grad_(), k, v, log_f, backend="sdpa")
    from hf_hybrid.kernels.forgetting_attention import sdpa

    assert not sdpa.applies(q, k, v, log_f, None, None)  # CPU: the automatic choice keeps its path


def test_switch_names_its_values(monkeypatch):
    from hf_hybrid.kernels.forgetting_attention import sdpa

    q, k, v, log_f = make_inputs(1, 8, 2, 2, 64, torch.float32)
    monkeypatch.setenv(sdpa.ENV_SWITCH, "on")
    with pytest.raises(ValueError, match=sdpa.ENV_SWITCH):
        sdpa.applies(q, k, v, log_f, None, None)


@pytest.mark.gpu
@pytest.mark.parametrize("gate_mean", [4.0, -1.0])  # mild and strong forgetting (c reaches -1000s)
def test_gpu_sdpa_bf16_real_lengths(gate_mean, monkeypatch):
    """Inference at a real length takes this path (on Hopper only when asked for: the Gluon forward
    is faster there) and is as close to the float32 reference as the Triton kernel; with gradients
    the automatic choice keeps the Triton kernels."""
    from hf_hybrid.kernels.forgetting_attention import sdpa

    q, k, v, log_f = make_inputs(1, 4099, 4, 2, 128, torch.bfloat16, gate_mean)
    if torch.cuda.get_device_capability()[0] == 9:
        assert not sdpa.applies(q, k, v, log_f, None, None)
        monkeypatch.setenv(sdpa.ENV_SWITCH, "sdpa")
    assert sdpa.applies(q, k, v, log_f, None, None)
    assert not sdpa.applies(q.requires_grad_(), k, v, log_f, None, None)
    q = q.detach()
    with torch.no_grad():
        got = forgetting_attention(q, k, v, log_f)
        tri = forgetting_attention(q, k, v, log_f, backend="triton")
    ref = forgetting_attention_reference(q.float(), k.float(), v.float(), log_f)
    assert rel_err(got, ref) < 1e-2 and rel_err(got, ref) < 1.5 * rel_err(tri, ref) + 1e-3, (rel_err(got, ref), rel_err(tri, ref))
