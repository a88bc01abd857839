"""Every Triton op is a torch.library custom op that torch.compile can treat as one node.

``torch.library.opcheck`` runs each op (Triton's CPU interpreter here, tiny shapes) and checks:
the schema (no undeclared mutation, no output aliasing an input), the fake implementation against
the real outputs (shapes, dtypes, strides), the autograd registration, and AOTAutograd tracing
with dynamic shapes. Numerical agreement with the references is in each op's own test file (the
public functions route through these ops); here each op is also compiled with fullgraph=True.
"""
from __future__ import annotations

import importlib

import pytest
import torch

from hf_hybrid.kernels._backend import triton_interpreting
from hf_hybrid.kernels.forgetting_attention import cumulative_log_forget_by_head
from hf_hybrid.layers.rotary import build_rotary

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and not triton_interpreting(), reason="needs CUDA or TRITON_INTERPRET=1"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

chunk_attention = importlib.import_module("hf_hybrid.kernels.chunk_attention")
forgetting = importlib.import_module("hf_hybrid.kernels.forgetting_attention")
fused_norm = importlib.import_module("hf_hybrid.kernels.fused_norm")
gated_recurrence = importlib.import_module("hf_hybrid.kernels.gated_recurrence")
output_gate = importlib.import_module("hf_hybrid.kernels.output_gate")
kv_shift = importlib.import_module("hf_hybrid.kernels.kv_shift")
rla = importlib.import_module("hf_hybrid.kernels.residual_linear_attention")
conv = importlib.import_module("hf_hybrid.kernels.causal_conv1d")
ssd = importlib.import_module("hf_hybrid.kernels.ssd_scan")
mixer = importlib.import_module("hf_hybrid.kernels.mamba2_mixer")
window = importlib.import_module("hf_hybrid.kernels.window_attention")


def leaf(*shape, scale: float = 1.0, grad: bool = True) -> torch.Tensor:
    return (scale * torch.randn(*shape, device=DEVICE)).requires_grad_(grad)


def rope_tables(seq: int, dim: int, chunk: int = 1):
    positions = torch.div(torch.arange(seq, device=DEVICE)[None], chunk, rounding_mode="floor")
    return build_rotary(dim, 10000.0).to(DEVICE)(positions)


def _cases():
    """(id, op, args): each op with and without its optional inputs."""
    torch.manual_seed(0)
    B, T, H, D = 2, 9, 2, 16
    q, k, v, z = (leaf(B, T, H, D) for _ in range(4))
    cos, sin = rope_tables(T, D)
    yield "sigmoid_gate", output_gate.sigmoid_gate_fwd, (leaf(3, 5), leaf(3, 5))
    yield "silu_gate", output_gate.silu_gate_fwd, (leaf(3, 5), leaf(3, 5))
    yield "kv_shift", kv_shift.kv_shift_fwd, (q, leaf(B, T, H), leaf(B, H, D))
    yield "kv_shift_no_previous", kv_shift.kv_shift_fwd, (q, leaf(B, T, H), None)
    yield "gated_recurrence", gated_recurrence.gated_recurrence_fwd, (q, torch.rand(B, T, H, D, device=DEVICE).requires_grad_(), 0, 0, None)
    yield "gated_recurrence_chunked_init", gated_recurrence.gated_recurrence_fwd, (
        q, torch.rand(B, T, H, D, device=DEVICE).requires_grad_(), 4, 3, leaf(B, H, D))
    kv_cos, kv_sin = rope_tables(T, D, chunk=4)
    yield "rat_keys_values", gated_recurrence.rat_keys_values_fwd, (leaf(B, T, 1, D), v, z, leaf(H * D), None, None, 4)
    yield "rat_keys_values_rope", gated_recurrence.rat_keys_values_fwd, (leaf(B, T, 1, D), v, z, leaf(H * D), kv_cos, kv_sin, 4)
    weight = leaf(H, D)
    yield "rms_norm_rotary", fused_norm.rms_norm_rotary_fwd, (q, weight, cos, sin, 1e-6)
    yield "rotary", fused_norm.rms_norm_rotary_fwd, (q, None, cos, sin, 0.0)
    yield "branch_norm_sum", fused_norm.branch_norm_sum_fwd, (q, weight, k, leaf(H, D), 1e-6, 1e-5)
    yield "branch_norm_one", fused_norm.branch_norm_sum_fwd, (q, weight, None, None, 1e-6, 1e-6)
    yield "block_end", chunk_attention.block_end_attention_fwd, (q, k, v, None, 4, 0, 0, D**-0.5, False)
    yield "block_end_gated_shared_q_window_sinks", chunk_attention.block_end_attention_fwd, (
        leaf(B, T, 1, D), k, v, z, 4, 2, 1, D**-0.5, True)
    yield "block_end_sdpa_gated_shared_q", chunk_attention.block_end_attention_sdpa_fwd, (leaf(B, T, 1, D), k, v, z, 4, D**-0.5)
    yield "block_end_sdpa", chunk_attention.block_end_attention_sdpa_fwd, (q, k, v, None, 2, D**-0.5)
    c_by_head = cumulative_log_forget_by_head(torch.nn.functional.logsigmoid(torch.randn(B, T, 2 * H, device=DEVICE)))
    yield "forgetting_attention_sdpa_gqa", forgetting.forgetting_attention_sdpa, (  # forward only
        leaf(B, T, 2 * H, D).detach(), k.detach(), v.detach(), c_by_head, D**-0.5)
    ends = leaf(B, 3, H, D), leaf(B, 3, H, D)
    query_chunk = torch.tensor([[0, 0, 0, 1, 1, 1, 2, 2, 3]] * B, device=DEVICE)
    yield "chunk_end", chunk_attention.chunk_end_attention_fwd, (q, k, v, *ends, query_chunk, D**-0.5)
    detached = [t.detach() for t in (q[:, :1], k[:, :1], v[:, :1], *ends)]
    yield "chunk_end_decode", chunk_attention.chunk_end_decode, (*detached, query_chunk[:, 2:3], D**-0.5)
    kq, kk, kv = leaf(B, T, 4, D), leaf(B, T, 2, D), leaf(B, T, 2, D)
    log_f = torch.nn.functional.logsigmoid(torch.randn(B, T, 4, device=DEVICE) + 2)
    c = cumulative_log_forget_by_head(log_f).requires_grad_()
    yield "forgetting", forgetting.forgetting_attention_fwd, (kq, kk, kv, c, None, D**-0.5, None)
    yield "forgetting_window", forgetting.forgetting_attention_fwd, (kq, kk, kv, c, None, D**-0.5, 3)
    cu = torch.tensor([0, 4, 9], device=DEVICE)
    packed = leaf(1, T, 4, D), leaf(1, T, 2, D), leaf(1, T, 2, D)
    c_packed = cumulative_log_forget_by_head(log_f[:1], cu).requires_grad_()
    yield "forgetting_packed", forgetting.forgetting_attention_fwd, (*packed, c_packed, cu, D**-0.5, None)
    yield "window_attention", window.window_attention_fwd, (kq, kk, kv, None, D**-0.5, 3)
    yield "window_attention_packed", window.window_attention_fwd, (*packed, cu, D**-0.5, 2)
    c_keys = c.detach().view(4, B, T).permute(1, 2, 0).contiguous()
    decode_args = (kq[:, :1].detach(), kk.detach(), kv.detach(), c_keys[:, 6:7], c_keys, torch.tensor([7], device=DEVICE))
    yield "forgetting_decode", forgetting.forgetting_attention_decode_op, (*decode_args, None, D**-0.5, None)
    yield "window_attention_decode", window.window_attention_decode_op, (*decode_args[:3], decode_args[5], D**-0.5, None)
    yield "window_attention_decode_window", window.window_attention_decode_op, (*decode_args[:3], decode_args[5], None, 3)
    mask = torch.rand(B, T, device=DEVICE) > 0.3
    yield "forgetting_decode_masked", forgetting.forgetting_attention_decode_op, (*decode_args, mask, None, 3)
    rq, rk, rv = leaf(1, 37, 2, D, scale=0.5), leaf(1, 37, 1, D, scale=0.5), leaf(1, 37, 1, D, scale=0.5)
    # chunk_size, block_v, state_every, num_warps, fuse_halves, heads_per_tile, chunk_parallel, half_launches
    defaults = (None,) * 8
    yield "rla", rla.residual_linear_attention_fwd, (rq, rk, rv, None, 3, "softmax", *defaults)
    yield "rla_state_segments", rla.residual_linear_attention_fwd, (
        rq, rk, rv, leaf(1, 1, 2 * D, D, scale=0.5), 3, "relu", None, None, 1, None, None, None, None, None)
    yield "rla_identity_pure_linear", rla.residual_linear_attention_fwd, (rq, rk, rv, None, -1, "identity", *defaults)
    yield "rla_one_head_per_tile", rla.residual_linear_attention_fwd, (
        rq, rk, rv, None, 3, "softmax", None, None, 1, None, None, 1, None, None)
    yield "rla_one_launch_per_half", rla.residual_linear_attention_fwd, (
        rq, rk, rv, None, 3, "softmax", None, None, 1, None, None, None, None, True)
    yield "rla_chunk_parallel", rla.residual_linear_attention_fwd, (
        rq, rk, rv, leaf(1, 1, 2 * D, D, scale=0.5), 3, "softmax", None, None, 1, None, None, None, True, None)
    # Mamba-2: depthwise causal conv1d and the SSD scan
    cx, cw, cb, cs = leaf(B, 11, 13), leaf(13, 4, scale=0.5), leaf(13), leaf(B, 13, 4)
    yield "causal_conv1d", conv.causal_conv1d_fwd, (cx, cw, None, None, False)
    yield "causal_conv1d_bias_state_silu", conv.causal_conv1d_fwd, (cx, cw, cb, cs, True)
    sx, sdt = leaf(B, 21, 4, 8), (0.1 + torch.rand(B, 21, 4, device=DEVICE)).requires_grad_()
    sA = (-torch.rand(4, device=DEVICE) - 0.2).requires_grad_()
    sB, sC = leaf(B, 21, 2, 6), leaf(B, 21, 2, 6)
    yield "ssd_scan", ssd.ssd_scan_fwd, (sx, sdt, sA, sB, sC, None, None, False)
    yield "ssd_scan_kept_states", ssd.ssd_scan_fwd, (sx, sdt, sA, sB, sC, None, None, True)
    yield "ssd_scan_D_state", ssd.ssd_scan_fwd, (sx, sdt, sA, sB, sC, leaf(4), leaf(B, 4, 8, 6), False)
    # the Mamba-2 mixer between its projections (4 heads x 8, 1 group of 6: 32 + 44 + 4 wide)
    mz, mw, mb = leaf(B, 21, 80), leaf(44, 4, scale=0.5), leaf(44)
    mixer_params = (sA, leaf(4), leaf(4), leaf(32))
    yield "mamba2_mixer", mixer.mamba2_mixer_fwd, (mz, mw, mb, *mixer_params, None, 8, 6, 16, 1e-6, 0.0, float("inf"), True, True)
    mixer_keep = torch.tensor([[0.0] * 3 + [1.0] * 18] * B, device=DEVICE)
    yield "mamba2_mixer_keep_limit", mixer.mamba2_mixer_fwd, (mz, mw, None, *mixer_params, mixer_keep, 8, 6, 32, 1e-6, 0.01, 2.0, True, False)
    # decode steps (no gradient): the RLA step out of place and in place, RAT's whole step in place
    dq, state = torch.randn(B, 4, D, device=DEVICE), torch.randn(B, 2, 2 * D, D, device=DEVICE)
    leaving = torch.randn(B, 2, D, device=DEVICE), torch.randn(B, 2, D, device=DEVICE)
    mask = torch.tensor([True, False], device=DEVICE)
    yield "rla_decode_step", rla.residual_linear_attention_decode_step, (dq, state, *leaving, mask, "softmax")
    yield "rla_decode_step_window_filling", rla.residual_linear_attention_decode_step, (dq, state, None, None, None, "relu")
    yield "rla_decode_inplace", rla.residual_linear_attention_decode_inplace, (dq, state.clone(), *leaving, None, "softmax")
    rows, residual_update = torch.randn(B, 1, 48, device=DEVICE), torch.randn(B, 1, 48, device=DEVICE)
    yield "add_rms_norm", importlib.import_module("hf_hybrid.kernels.residual_norm").add_rms_norm_op, (
        rows, residual_update, torch.randn(48, device=DEVICE), 1e-6)
    yield "rms_norm_rows", importlib.import_module("hf_hybrid.kernels.residual_norm").rms_norm_rows_op, (
        rows, torch.randn(48, device=DEVICE), 1e-6)
    yield "rms_norm_rows_train", importlib.import_module("hf_hybrid.kernels.residual_norm").rms_norm_rows_op, (
        torch.randn(B, 5, 48, device=DEVICE, requires_grad=True), torch.randn(48, device=DEVICE, requires_grad=True), 1e-6)
    ring = lambda: torch.randn(B, 4, 2, D, device=DEVICE)  # noqa: E731  (a window of 3 + the token)
    yield "rattention_ring_decode", rla.ring_decode_op, (
        dq, *leaving, leaving[0], state.clone(), ring(), ring(), ring(), torch.tensor([6], device=DEVICE), "softmax")
    conv_state = torch.randn(B, 13, 4, device=DEVICE)
    step_x = torch.randn(B, 13, device=DEVICE)
    yield "causal_conv1d_step", conv.causal_conv1d_step_op, (
        step_x, conv_state, cw.detach(), cb.detach(), "silu", torch.empty_like(step_x))
    ssm_state = torch.randn(B, 4, 8, 6, device=DEVICE)
    step_in = torch.randn(B, 4, 8, device=DEVICE)
    yield "ssd_step", ssd.ssd_step_op, (
        ssm_state, step_in, torch.randn(B, 4, device=DEVICE), sA.detach(), torch.randn(B, 2, 6, device=DEVICE),
        torch.randn(B, 2, 6, device=DEVICE), torch.randn(4, device=DEVICE), torch.randn(4, device=DEVICE), True,
        0.0, float("inf"), torch.empty_like(step_in))
    position = torch.tensor([9], device=DEVICE)
    step_cos, step_sin = rope_tables(1, D)
    rand = lambda *shape: torch.randn(*shape, device=DEVICE)
    yield "rat_decode_step", chunk_attention.rat_decode_step_op, (
        rand(B, 1, 2, D), rand(B, 1, 2, D), rand(B, 1, 4, D), rand(B, 1, 4, D), rand(4 * D), rand(B, 4, D),
        rand(B, 4, D), position, 4, step_cos, step_sin, rand(B, 5, 4, D), rand(B, 5, 4, D), None, rand(B, 1, 4, D))
    # RAT+'s step on a dilated static store [2 sinks | 6 block ends | ring of 3] (D=4, W=2)
    stored = torch.tensor([[0, -1, 3, 7, -1, -1, -1, -1, 9, 8, -1]] * B, device=DEVICE)
    yield "rat_plus_decode_step", chunk_attention.rat_plus_decode_step_op, (
        rand(B, 1, 4, D), rand(B, 1, 2, D), rand(B, 1, 2, D), rand(B, 1, 2, D), rand(B, 2, D), rand(B, 2, D),
        position, step_cos, step_sin, rand(B, 11, 2, D), rand(B, 11, 2, D), stored,
        torch.ones(B, 2, dtype=torch.bool, device=DEVICE), 2, 8, 3, 4, 2, 2, None, rand(B, 1, 4, D))


CASES = list(_cases())


_SLOW_OPCHECK = {"ssd_scan", "ssd_scan_D_state", "gated_recurrence_chunked_init", "mamba2_mixer_keep_limit"}  # 20-25 s each interpreted


@pytest.mark.parametrize(
    "op, args", [pytest.param(*case[1:], marks=pytest.mark.slow) if case[0] in _SLOW_OPCHECK else case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_opcheck(op, args):
    torch.library.opcheck(op, args)


def test_every_public_triton_op_is_a_custom_op_in_the_namespace():
    ops = {
        "sigmoid_gate_fwd", "sigmoid_gate_bwd", "silu_gate_fwd", "silu_gate_bwd", "kv_shift_fwd", "kv_shift_bwd", "gated_recurrence_fwd", "gated_recurrence_bwd",
        "rat_keys_values_fwd", "rat_keys_values_bwd", "rms_norm_rotary_fwd", "rms_norm_rotary_bwd",
        "branch_norm_sum_fwd", "branch_norm_sum_bwd", "block_end_attention_fwd", "block_end_attention_bwd",
        "block_end_attention_sdpa_fwd", "block_end_attention_sdpa_bwd",
        "forgetting_attention_sdpa",
        "chunk_end_attention_fwd", "chunk_end_attention_bwd", "chunk_end_decode",
        "forgetting_attention_fwd", "forgetting_attention_bwd", "forgetting_attention_decode",
        "window_attention_fwd", "window_attention_bwd", "window_attention_decode",
        "residual_linear_attention_fwd", "residual_linear_attention_bwd",
        "residual_linear_attention_decode_step", "residual_linear_attention_decode_inplace", "rat_decode_step",
        "rat_plus_decode_step", "rattention_ring_decode", "add_rms_norm", "rms_norm_rows", "rms_norm_rows_bwd",
        "causal_conv1d_fwd", "causal_conv1d_bwd", "ssd_scan_fwd", "ssd_scan_bwd", "causal_conv1d_step", "ssd_step",
        "mamba2_mixer_fwd", "mamba2_mixer_bwd",
    }
    missing = {name for name in ops if not hasattr(torch.ops.hf_hybrid, name)}
    assert not missing, f"not registered under torch.ops.hf_hybrid: {sorted(missing)}"


def test_public_ops_compile_fullgraph_and_match_eager():
    """Each public function on the Triton backend, compiled whole (forward + backward): equal to eager."""
    torch.manual_seed(0)
    B, T, H, D = 1, 9, 2, 16
    q, k, v, z = (leaf(B, T, H, D) for _ in range(4))
    cos, sin = rope_tables(T, D, chunk=4)
    weight = leaf(H, D)

    def step(q, k, v, z, weight):
        k_rot, v_tilde = gated_recurrence.rat_keys_values(k[:, :, :1], v, z, weight.reshape(-1), 4, (cos, sin), backend="triton")
        x = fused_norm.rms_norm_rotary(q, weight, 1e-6, (cos, sin), backend="triton")
        y = chunk_attention.block_end_attention(x[:, :, :1], k_rot, v_tilde, 4, backend="triton", output_gate=z)
        y = output_gate.sigmoid_gate(z, y, backend="triton")
        h = gated_recurrence.gated_recurrence(y, torch.sigmoid(z), 4, backend="triton")
        h = window.window_attention(h, k, v, window_size=3, backend="triton")
        o, state = rla.residual_linear_attention(h, k, v, 2, backend="triton")
        return fused_norm.branch_norm_sum(o, weight, h, weight, 1e-6, backend="triton").square().sum() + state.sum()

    inputs = (q, k, v, z, weight)
    eager = torch.autograd.grad(step(*inputs), inputs)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    grads = torch.autograd.grad(compiled(*inputs), inputs)
    for name, a, b in zip("q k v z weight".split(), grads, eager):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"d{name}: {m}")


def test_eager_calls_skip_the_dispatcher_and_match_the_registered_op():
    """Eager calls of a kernel op run its body directly (an autograd.Function built from the same
    setup / backward when gradients are needed); the registered op gives the same values and
    gradients, and keywords, fake tensors and torch.compile still take the registered op."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    a, b = leaf(2, 5, 3, 16), leaf(2, 5, 3, 16)
    wa, wb = leaf(3, 16), leaf(3, 16)
    args = (a, wa, b, wb, 1e-6, 1e-5)
    direct = fused_norm.branch_norm_sum_fwd(*args)
    registered = torch.ops.hf_hybrid.branch_norm_sum_fwd(*args)
    assert type(direct.grad_fn).__name__ == "Eager_branch_norm_sum_fwdBackward"
    assert "Eager" not in type(registered.grad_fn).__name__
    torch.testing.assert_close(direct, registered, rtol=0, atol=0)
    dy = torch.randn_like(direct)
    for got, want in zip(torch.autograd.grad(direct, (a, wa, b, wb), dy), torch.autograd.grad(registered, (a, wa, b, wb), dy)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with torch.no_grad():
        assert fused_norm.branch_norm_sum_fwd(*args).grad_fn is None
    keyword = fused_norm.branch_norm_sum_fwd(a, wa, b, wb, eps_a=1e-6, eps_b=1e-5)
    assert "Eager" not in type(keyword.grad_fn).__name__
    with FakeTensorMode() as mode:
        fake = fused_norm.branch_norm_sum_fwd(*(mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in args))
    assert fake.shape == direct.shape


def test_other_torch_versions_keep_torchs_own_op():
    """The eager fast path swaps the class of torch's private CustomOpDef: only checked versions
    get it; elsewhere the op stays torch's object and every call goes through the dispatcher."""
    from hf_hybrid._compat import torch_custom_ops

    assert torch_custom_ops.torch_checked("2.11.0") and torch_custom_ops.torch_checked("2.13.0+cu128")
    assert not torch_custom_ops.torch_checked("2.14.0") and not torch_custom_ops.torch_checked("2.10.1")

    def body(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    op = torch.library.custom_op("hf_hybrid_test::unchecked_torch_probe", mutates_args=())(body)
    original = torch_custom_ops.torch_checked
    torch_custom_ops.torch_checked = lambda version=None: False
    try:
        assert type(torch_custom_ops.with_eager_fast_path(op, 1)) is torch_custom_ops.CustomOpDef
    finally:
        torch_custom_ops.torch_checked = original
    assert type(torch_custom_ops.with_eager_fast_path(op, 1)) is torch_custom_ops.EagerKernelOp
    assert torch.equal(op(torch.ones(3)), torch.full((3,), 2.0))
