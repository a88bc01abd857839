"""mamba2_mixer (the Mamba-2 mixer between its projections as one op): the Triton path against the
composed references, forward and backward (fp32 and bf16, odd lengths, padding, dt limits, no conv
bias), the gradient written into one in_proj buffer, and bad arguments named."""
from __future__ import annotations

import importlib

import pytest
import torch

mixer = importlib.import_module("hf_hybrid.kernels.mamba2_mixer")

pytestmark = pytest.mark.filterwarnings("ignore:.*falling back.*")


def inputs(batch=2, seq=37, heads=4, head_dim=8, groups=2, state=6, width=4, dtype=torch.float32, bias=True, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape, scale=1.0: (torch.randn(*shape, generator=gen) * scale).to(device)  # noqa: E731
    inner = heads * head_dim
    channels = inner + 2 * groups * state
    return dict(
        zxbcdt=r(batch, seq, inner + channels + heads).to(dtype),
        conv_weight=r(channels, width, scale=0.5).to(dtype),
        conv_bias=r(channels, scale=0.2).to(dtype) if bias else None,
        A=-torch.exp(r(heads, scale=0.5)),
        D=r(heads).to(dtype),
        dt_bias=r(heads, scale=0.5).to(dtype),
        norm_weight=(1 + r(inner, scale=0.1)).to(dtype),
    ), dict(head_dim=head_dim, state_size=state)


def run(tensors, sizes, backend, grad_out, **options):
    leaves = {k: v.detach().clone().requires_grad_() for k, v in tensors.items() if v is not None}
    args = {**tensors, **leaves}
    normed, y = mixer.mamba2_mixer(**args, **sizes, backend=backend, **options)
    grads = torch.autograd.grad((normed.float() * grad_out).sum(), list(leaves.values()))
    return dict(normed=normed, y=y, **{f"d{k}": g for k, g in zip(leaves, grads)})


CASES = [  # (seq, groups, norm groups, bias, padded, dt_limit)
    (37, 2, 1, True, False, (0.0, float("inf"))),  # odd length, several chunks, grouped B / C
    (16, 1, 2, False, True, (0.0, float("inf"))),  # one chunk, left padding, no conv bias, a grouped norm
    (5, 2, 4, True, True, (0.05, 0.8)),  # shorter than a chunk; clamped steps
]


def _error(got: torch.Tensor, exact: torch.Tensor) -> float:
    """Largest error relative to the exact tensor's largest entry (at least 1)."""
    return ((got.float() - exact.float()).abs().max() / exact.float().abs().max().clamp(min=1.0)).item()


def run_op_by_op(tensors, sizes, grad_out, norm_group_size, eps, dt_limit=(0.0, float("inf")), keep=None):
    """conv -> ssd_scan -> gated_rms_norm as separate Triton ops (their autograd concatenating the
    gradients): what the mixer computed before it was one op."""
    from hf_hybrid.kernels.causal_conv1d import causal_conv1d
    from hf_hybrid.kernels.gated_rms_norm import gated_rms_norm
    from hf_hybrid.kernels.ssd_scan import ssd_scan

    leaves = {k: v.detach().clone().requires_grad_() for k, v in tensors.items() if v is not None}
    args = {**tensors, **leaves}
    heads, head_dim, state = args["A"].shape[0], sizes["head_dim"], sizes["state_size"]
    inner, channels = heads * head_dim, args["conv_weight"].shape[0]
    z, xBC, dt = args["zxbcdt"].split([inner, channels, heads], dim=-1)
    conv = causal_conv1d(xBC, args["conv_weight"], args["conv_bias"], activation="silu", backend="triton")
    if keep is not None:
        conv = conv * keep[..., None].to(conv.dtype)
    group_width = (channels - inner) // 2
    x, B, C = conv.split([inner, group_width, group_width], dim=-1)
    y = ssd_scan(x.unflatten(-1, (heads, head_dim)), dt, args["A"], B.unflatten(-1, (-1, state)), C.unflatten(-1, (-1, state)),
                 D=args["D"], dt_bias=args["dt_bias"], dt_softplus=True, dt_limit=dt_limit, backend="triton").flatten(-2)
    normed = gated_rms_norm(y, z, args["norm_weight"], norm_group_size, eps, backend="triton")
    grads = torch.autograd.grad((normed.float() * grad_out).sum(), list(leaves.values()))
    return dict(normed=normed, y=y, **{f"d{k}": g for k, g in zip(leaves, grads)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq, groups, norm_groups, bias, padded, dt_limit", CASES)
def test_triton_matches_reference_and_the_ops_one_by_one(dtype, seq, groups, norm_groups, bias, padded, dt_limit):
    """The one op against the ops run one by one (the same kernels: round-off of the summation
    order) and against the reference: to float32 round-off in float32; in bfloat16, to the bf16
    kernels' distance from the float32 math (gradients that sum cancelling bf16 terms over tokens,
    e.g. the step sizes' and the conv weight's, differ by up to ~17% of their largest entry at these
    tiny shapes)."""
    tensors, sizes = inputs(seq=seq, groups=groups, dtype=dtype, bias=bias)
    keep = None
    if padded:
        keep = torch.ones(2, seq)
        keep[0, : seq // 3 + 1] = 0
    grad_out = torch.randn(2, seq, 32, generator=torch.Generator().manual_seed(5))
    options = dict(norm_group_size=32 // norm_groups, eps=1e-6, dt_limit=dt_limit, keep=keep)
    whole = run(tensors, sizes, "triton", grad_out, **options)
    separate = run_op_by_op(tensors, sizes, grad_out, **options)
    exact = run({k: v if v is None else v.float() for k, v in tensors.items()}, sizes, "reference", grad_out, **options)
    tight, loose = (2e-5, 2e-5) if dtype == torch.float32 else (1e-2, 0.25)
    for name, expected in separate.items():
        got = whole[name]
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        assert _error(got, expected) <= tight, f"{name} against the ops one by one: {_error(got, expected):.2e}"
        assert _error(got, exact[name]) <= loose, f"{name} against the float32 reference: {_error(got, exact[name]):.2e}"


def test_y_is_not_differentiable_and_no_grad_keeps_nothing():
    tensors, sizes = inputs(seq=9)
    with torch.no_grad():
        normed, y = mixer.mamba2_mixer(**tensors, **sizes, norm_group_size=32, eps=1e-6, backend="triton")
    assert not normed.requires_grad and y.shape == (2, 9, 32)
    leaves = {k: v.requires_grad_() for k, v in tensors.items()}
    normed, y = mixer.mamba2_mixer(**leaves, **sizes, norm_group_size=32, eps=1e-6, backend="triton")
    assert normed.requires_grad and not y.requires_grad


def test_the_backward_rebuilds_what_the_forward_did_not_keep(monkeypatch):
    """A training forward keeps the chunk states and the conv output while the states fit
    KEEP_STATES_MAX_BYTES; past it the backward rebuilds both, to the same gradients."""
    from hf_hybrid.kernels.ssd_scan import triton as ssd_triton

    tensors, sizes = inputs(seq=21, dtype=torch.float32)
    grad_out = torch.randn(2, 21, 32, generator=torch.Generator().manual_seed(3))
    options = dict(norm_group_size=32, eps=1e-6, keep=torch.ones(2, 21))
    leaves = [tensors["zxbcdt"].detach().requires_grad_(), *(tensors[k] for k in ("conv_weight", "conv_bias", "A", "D", "dt_bias", "norm_weight"))]
    args = (*leaves, None, sizes["head_dim"], sizes["state_size"], 32, 1e-6, 0.0, float("inf"), True)
    _, _, states, conv = mixer.mamba2_mixer_fwd(*args, True)
    assert conv.shape == (2, 21, tensors["conv_weight"].shape[0]) and states.numel() > 0
    assert all(t.numel() == 0 for t in mixer.mamba2_mixer_fwd(*args, False)[2:])

    kept = run(tensors, sizes, "triton", grad_out, **options)
    monkeypatch.setattr(ssd_triton, "KEEP_STATES_MAX_BYTES", 0)
    rebuilt = run(tensors, sizes, "triton", grad_out, **options)
    for name, expected in kept.items():
        torch.testing.assert_close(rebuilt[name], expected, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("change, match", [
    (dict(zxbcdt=torch.randn(2, 9, 91)), "zxbcdt's last dim"),
    (dict(head_dim=7), "conv_weight must be"),
    (dict(state_size=5), "conv_weight must be"),
    (dict(norm_group_size=5), "norm_group_size"),
    (dict(keep=torch.ones(2, 3)), "keep must be"),
    (dict(D=torch.ones(3)), "D must be"),
    (dict(activation="gelu"), "activation"),
    (dict(dt_limit=(1.0, 0.5)), "dt_limit"),
])
def test_bad_arguments_name_the_parameter(change, match):
    tensors, sizes = inputs(seq=9)
    arguments = {**tensors, **sizes, "norm_group_size": 32, "eps": 1e-6, **change}
    with pytest.raises(ValueError, match=match):
        mixer.mamba2_mixer(**arguments, backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_gpu_triton_matches_reference(dtype, tol):
    """The SE hybrid's mixer shape (64-wide heads, state 128, one group) at an odd length."""
    tensors, sizes = inputs(batch=2, seq=1000, heads=8, head_dim=64, groups=1, state=128, dtype=dtype, device="cuda")
    grad_out = torch.randn(2, 1000, 512, device="cuda")
    options = dict(norm_group_size=512, eps=1e-6)
    ref = run(tensors, sizes, "reference", grad_out, **options)
    tri = run(tensors, sizes, "triton", grad_out, **options)
    for name, expected in ref.items():
        scale = expected.float().abs().max().clamp(min=1e-3)
        torch.testing.assert_close(tri[name].float() / scale, expected.float() / scale, rtol=tol, atol=tol, msg=name)
