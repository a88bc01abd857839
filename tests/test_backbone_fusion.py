"""The fused path of the shared backbone (hf_hybrid/layers/backbone_fusion.py) against our PyTorch
path: the RMSNorm and SwiGLU kernels and a whole model with every fused op are compared on the GPU
(the kernels against their references in Triton's interpreter too: tests/kernels/test_residual_norm.py,
test_output_gate.py). The fused loss is tested in test_fused_loss.py."""
from __future__ import annotations

import pytest
import torch

from hf_hybrid.layers import backbone_fusion
from hf_hybrid.layers.mlp import SwiGLUMLP
from hf_hybrid.layers.norm import RMSNorm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def fusion():
    """Turn the fused path on (also for CPU tensors: Triton's interpreter) and restore afterwards."""
    previous = backbone_fusion._enabled, backbone_fusion._allow_cpu, backbone_fusion._min_tokens
    backbone_fusion.set_backbone_fusion(True, allow_cpu=True, min_tokens=0)
    yield backbone_fusion
    backbone_fusion._enabled, backbone_fusion._allow_cpu, backbone_fusion._min_tokens = previous


def _unfused(fn):
    previous = backbone_fusion._enabled
    backbone_fusion._enabled = False
    try:
        return fn()
    finally:
        backbone_fusion._enabled = previous


def test_fusion_is_off_on_cpu_by_default():
    assert not backbone_fusion.fused_layer_applies(torch.zeros(2, 2048, 8))


def test_layer_kernels_wait_for_enough_tokens(fusion):
    """Eager decode steps (a few tokens) keep the PyTorch norm and SwiGLU (see FUSED_MIN_TOKENS)."""
    fusion.set_backbone_fusion(True, min_tokens=fusion.FUSED_MIN_TOKENS)  # the default threshold
    assert not fusion.fused_layer_applies(torch.zeros(32, 1, 16))
    assert fusion.fused_layer_applies(torch.zeros(1, fusion.FUSED_MIN_TOKENS, 16))
    assert fusion.fused_loss_applies(torch.zeros(32, 1, 16))  # the loss has no threshold


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_rms_norm_fused_matches_pytorch(fusion, dtype, tol):
    torch.manual_seed(0)
    norm = RMSNorm(48, eps=1e-6).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(48) + 0.5)
    x = torch.randn(2, 5, 48, device=DEVICE, dtype=dtype, requires_grad=True)  # odd length
    grad = torch.randn(2, 5, 48, device=DEVICE, dtype=dtype)

    def run():
        x.grad = norm.weight.grad = None
        y = norm.to(dtype)(x)
        y.backward(grad)
        return y.detach().float(), x.grad.float(), norm.weight.grad.float()

    fused = run()
    reference = _unfused(run)
    for got, want, name in zip(fused, reference, ("y", "dx", "dweight")):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_per_head_norm_keeps_the_pytorch_path():
    norm = RMSNorm((3, 8)).cuda()
    x = torch.randn(2, 4, 3, 8, device="cuda")
    torch.testing.assert_close(norm(x), _unfused(lambda: norm(x)), atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_swiglu_fused_matches_pytorch_on_gpu(fusion, dtype, tol):
    torch.manual_seed(0)
    mlp = SwiGLUMLP(64, 96).cuda().to(dtype)
    x = torch.randn(3, 17, 64, device="cuda", dtype=dtype, requires_grad=True)

    def run():
        x.grad = None
        mlp.zero_grad()
        y = mlp(x)
        y.float().square().sum().backward()
        return [y.detach().float(), x.grad.float()] + [p.grad.float() for p in mlp.parameters()]

    assert backbone_fusion.fused_layer_applies(x)
    for got, want in zip(run(), _unfused(run)):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_norm_and_swiglu_kernels_run_and_match_pytorch(fusion):
    """On any device (CPU: Triton's interpreter): the fused layers take the kernels and match the
    PyTorch lines, forward and backward, in float32."""
    torch.manual_seed(0)
    norm, mlp = RMSNorm(32).to(DEVICE), SwiGLUMLP(32, 48).to(DEVICE)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(2, 5, 32, device=DEVICE, requires_grad=True)

    def run():
        for p in (x, *norm.parameters(), *mlp.parameters()):
            p.grad = None
        y = mlp(norm(x))
        y.square().sum().backward()
        return [y.detach(), x.grad] + [p.grad for p in (*norm.parameters(), *mlp.parameters())]

    assert backbone_fusion.fused_layer_applies(x)
    for got, want in zip(run(), _unfused(run)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_whole_model_fused_matches_unfused_on_gpu(fusion):
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_hybrid.architectures import architecture

    torch.manual_seed(0)
    config = AutoConfig.for_model("rat", **architecture("rat").tiny_config_kwargs())
    model = AutoModelForCausalLM.from_config(config).cuda().train()
    ids = torch.randint(0, config.vocab_size, (2, 33), device="cuda")

    def run():
        model.zero_grad()
        out = model(ids, labels=ids, use_cache=False)
        out.loss.backward()
        return out.loss.detach(), [p.grad.clone() for p in model.parameters()]

    assert backbone_fusion.fused_layer_applies(torch.zeros(2, 33, 32, device="cuda"))
    (loss, grads), (loss_ref, grads_ref) = run(), _unfused(run)
    torch.testing.assert_close(loss, loss_ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)
