"""ssd_scan / ssd_step / mamba2_decode_step: the chunked reference against transformers' Bamba SSD
(fp32 round-off) and a token-by-token recurrence, chunk-size independence, carried states, and the
Triton kernels (interpreter on CPU) against the reference, forward and backward."""
from __future__ import annotations

import pytest
import torch
from transformers.models.bamba import modeling_bamba

from hf_hybrid.kernels.causal_conv1d import causal_conv1d
from hf_hybrid.kernels.ssd_scan import mamba2_decode_step, ssd_scan, ssd_scan_reference, ssd_step
from hf_hybrid.kernels.ssd_scan.reference import discretize_dt

pytestmark = pytest.mark.filterwarnings("ignore:.*falling back.*")


def inputs(batch=2, seq=21, heads=4, head_dim=8, groups=2, state=6, dtype=torch.float32, seed=0, initial=True):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    return dict(
        x=r(batch, seq, heads, head_dim).to(dtype),
        dt=r(batch, seq, heads),
        A=-torch.exp(r(heads) * 0.5),
        B=r(batch, seq, groups, state).to(dtype),
        C=r(batch, seq, groups, state).to(dtype),
        D=r(heads),
        dt_bias=r(heads),
        initial_state=r(batch, heads, head_dim, state) if initial else None,
    )


def recurrence(x, dt, A, B, C, D, initial_state):
    """Token by token S_t = exp(dt A) S_{t-1} + dt x B^T, y = S C + D x (the definition)."""
    heads = x.shape[2]
    B, C = (t.float().repeat_interleave(heads // t.shape[2], dim=2) for t in (B, C))
    S = initial_state.float().clone()
    ys = []
    for t in range(x.shape[1]):
        S = S * torch.exp(dt[:, t] * A)[..., None, None] + (dt[:, t, :, None] * x[:, t].float())[..., None] * B[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", S, C[:, t]) + D[:, None] * x[:, t].float())
    return torch.stack(ys, 1), S


@pytest.mark.parametrize("seq, chunk, limit", [(21, 8, (0.0, float("inf"))), (16, 16, (0.3, 1.5)), (5, 8, (0.0, float("inf")))])
def test_reference_matches_bamba_chunk_scan(seq, chunk, limit):
    """Bamba's torch_forward SSD (transformers' fallback) is the math the mixer must keep."""
    t = inputs(seq=seq)
    y, state = ssd_scan(**t, dt_softplus=True, dt_limit=limit, chunk_size=chunk, return_final_state=True, backend="reference")
    y_bamba, state_bamba = modeling_bamba.mamba2_chunk_scan(
        t["x"], t["dt"], t["A"], t["B"], t["C"], chunk, D=t["D"], dt_bias=t["dt_bias"], dt_softplus=True,
        initial_states=t["initial_state"], dt_limit=limit, return_final_states=True,
    )
    torch.testing.assert_close(y, y_bamba, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, state_bamba, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 4, 7, 64])
def test_reference_is_the_recurrence_for_any_chunk_size(chunk):
    t = inputs(seq=19)
    dt = discretize_dt(t["dt"], t["dt_bias"], True)
    y, state = ssd_scan_reference(t["x"], dt, t["A"], t["B"], t["C"], t["D"], t["initial_state"], chunk, True)
    y_rec, state_rec = recurrence(t["x"], dt, t["A"], t["B"], t["C"], t["D"], t["initial_state"])
    torch.testing.assert_close(y, y_rec, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, state_rec, rtol=1e-5, atol=1e-5)


def test_reference_gradients_are_exact():
    """Per-chunk checkpointing recomputes the forward: gradcheck in float64 through it."""
    t = inputs(batch=1, seq=7, heads=2, head_dim=2, groups=1, state=3)
    t = {k: v.double().requires_grad_() for k, v in t.items() if k != "dt_bias"}

    def fn(x, dt, A, B, C, D, initial_state):
        y, s = ssd_scan_reference(x, torch.nn.functional.softplus(dt), A, B, C, D, initial_state, 3, True)
        return y, s

    assert torch.autograd.gradcheck(fn, tuple(t.values()))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_carried_state_and_steps_continue_the_sequence(backend):
    t = inputs(seq=23, initial=False)
    kw = dict(D=t["D"], dt_bias=t["dt_bias"], dt_softplus=True, backend=backend)
    full, full_state = ssd_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], return_final_state=True, **kw)
    cut = lambda k, a, b: t[k][:, a:b]  # noqa: E731
    first, state = ssd_scan(cut("x", 0, 17), cut("dt", 0, 17), t["A"], cut("B", 0, 17), cut("C", 0, 17), return_final_state=True, **kw)
    ys = [first]
    for i in range(17, 23):
        ys.append(ssd_step(state, t["x"][:, i], t["dt"][:, i], t["A"], t["B"][:, i], t["C"][:, i], **kw)[:, None])
    torch.testing.assert_close(torch.cat(ys, 1), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, full_state, rtol=1e-5, atol=1e-5)


def test_step_matches_bamba_selective_state_update():
    t = inputs(seq=1)
    ours, theirs = t["initial_state"].clone(), t["initial_state"].clone()
    y = ssd_step(ours, t["x"][:, 0], t["dt"][:, 0], t["A"], t["B"][:, 0], t["C"][:, 0], D=t["D"], dt_bias=t["dt_bias"],
                 dt_softplus=True, backend="reference")
    P, N = ours.shape[-2:]
    y_bamba = modeling_bamba.mamba2_selective_state_update(
        theirs, t["x"][:, 0], t["dt"][:, 0, :, None].expand(-1, -1, P), t["A"][:, None, None].expand(-1, P, N),
        t["B"][:, 0], t["C"][:, 0], t["D"][:, None].expand(-1, P), dt_bias=t["dt_bias"][:, None].expand(-1, P), dt_softplus=True,
    )
    torch.testing.assert_close(y, y_bamba, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


CASES = [  # (seq, heads, head_dim, groups, state, initial, D)
    (37, 4, 8, 2, 6, True, True),  # odd length, several chunks, grouped B/C
    (16, 2, 16, 1, 16, False, False),  # exactly one chunk
    (3, 3, 5, 3, 20, True, True),  # shorter than a chunk; a state above one N block
]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("seq, heads, head_dim, groups, state, initial, use_D", CASES)
def test_triton_matches_reference_forward_and_backward(dtype, tol, seq, heads, head_dim, groups, state, initial, use_D):
    t = inputs(seq=seq, heads=heads, head_dim=head_dim, groups=groups, state=state, dtype=dtype, initial=initial)
    if not use_D:
        t["D"] = None
    leaves = {k: v.requires_grad_() for k, v in t.items() if v is not None}
    gen = torch.Generator().manual_seed(9)
    grad_y = torch.randn(t["x"].shape, generator=gen).to(dtype)
    grad_state = torch.randn(t["x"].shape[0], heads, head_dim, state, generator=gen)
    results = {}
    for backend in ("reference", "triton"):
        y, final = ssd_scan(**t, dt_softplus=True, dt_limit=(0.01, 5.0), return_final_state=True, chunk_size=8, backend=backend)
        loss = (y.float() * grad_y.float()).sum() + (final * grad_state).sum()
        results[backend] = dict(y=y, final=final, **dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values())))))
    for name, ref in results["reference"].items():
        tri = results["triton"][name]
        assert tri.dtype == ref.dtype and tri.shape == ref.shape, name
        scale = ref.float().abs().max().clamp(min=1.0)
        torch.testing.assert_close(tri.float() / scale, ref.float() / scale, rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("heads_per_launch", [1, 2])
def test_triton_backward_in_slices_of_heads_is_the_whole_one(heads_per_launch, monkeypatch):
    """_chunk_bwd runs one slice of heads per launch (slices inside a group and of whole groups) when
    all heads' dB / dC parts would take more than CHUNK_BWD_PARTS_MAX_BYTES."""
    from hf_hybrid.kernels.ssd_scan import triton as ssd_triton

    t = inputs(seq=21, heads=4, head_dim=8, groups=2, state=6, dtype=torch.float32, initial=True)
    per_head = 2 * 2 * 21 * 6 * 4  # dB and dC parts of one head: batch x seq x state float32
    grads = []
    for target in (4, heads_per_launch):
        monkeypatch.setattr(ssd_triton, "CHUNK_BWD_PARTS_MAX_BYTES", target * per_head + per_head // 2)
        leaves = {k: v.detach().clone().requires_grad_() for k, v in t.items() if v is not None}
        y, final = ssd_scan(**leaves, dt_softplus=True, return_final_state=True, chunk_size=8, backend="triton")
        loss = y.square().sum() + final.square().sum()
        grads.append(torch.autograd.grad(loss, list(leaves.values())))
    assert ssd_triton._heads_per_launch(4, 2, per_head) == heads_per_launch
    for whole, sliced in zip(*grads):
        torch.testing.assert_close(sliced, whole, rtol=1e-6, atol=1e-6)


def test_triton_gradients_from_the_final_state_alone():
    """A loss of the final state only: y gets no gradient (none is zero-filled for it, nor for the
    kept states); the gradients are the reference's (C and D take no part: zeros)."""
    t = inputs(seq=21, heads=4, head_dim=8, groups=2, state=6)
    grads = {}
    for backend in ("reference", "triton"):
        leaves = {k: v.detach().clone().requires_grad_() for k, v in t.items() if v is not None}
        _, final = ssd_scan(**leaves, dt_softplus=True, return_final_state=True, chunk_size=8, backend=backend)
        grads[backend] = torch.autograd.grad(final.square().sum(), list(leaves.values()), allow_unused=True, materialize_grads=True)
    for name, tri, ref in zip([k for k, v in t.items() if v is not None], grads["triton"], grads["reference"]):
        torch.testing.assert_close(tri, ref, rtol=2e-5, atol=2e-5, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_backward_from_kept_states_is_the_recomputed_one(dtype, monkeypatch):
    """A training forward keeps the chunk states (in x's dtype) up to KEEP_STATES_MAX_BYTES; the
    backward from them equals the backward that recomputes them, bit for bit; a no-grad forward keeps none."""
    from hf_hybrid.kernels.ssd_scan import ssd_scan_fwd
    from hf_hybrid.kernels.ssd_scan import triton as ssd_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter
    t = {k: v.to(device) for k, v in inputs(seq=37, heads=4, head_dim=8, groups=2, state=6, dtype=dtype).items()}
    results = []
    for limit in (2**40, 0):
        monkeypatch.setattr(ssd_triton, "KEEP_STATES_MAX_BYTES", limit)
        leaves = {k: v.detach().clone().requires_grad_() for k, v in t.items() if v is not None}
        y, final = ssd_scan(**leaves, dt_softplus=True, return_final_state=True, backend="triton")
        loss = y.float().square().sum() + final.square().sum()
        results.append((y, final, *torch.autograd.grad(loss, list(leaves.values()))))
    assert ssd_triton.keeps_states(t["x"], t["B"]) is False  # limit 0
    for kept, recomputed in zip(*results):
        assert torch.equal(kept, recomputed)
    monkeypatch.setattr(ssd_triton, "KEEP_STATES_MAX_BYTES", 2**40)
    dt = discretize_dt(t["dt"], t["dt_bias"], True)
    *_, kept = ssd_scan_fwd(t["x"], dt, t["A"], t["B"], t["C"], t["D"], t["initial_state"], True)
    assert kept.dtype == dtype and kept.shape[:3] == (2, 37 // ssd_triton._sizes()[0] + 2, 4)
    from hf_hybrid.kernels.ssd_scan import _keeps_states

    x = t["x"].clone().requires_grad_()
    assert _keeps_states(x, dt, t["A"], t["B"], t["C"], t["D"], None)
    with torch.no_grad():
        assert not _keeps_states(x, dt, t["A"], t["B"], t["C"], t["D"], None)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_triton_step_matches_reference(dtype, tol):
    t = inputs(seq=1, dtype=dtype)
    states = {b: t["initial_state"].clone() for b in ("reference", "triton")}
    ys = {}
    for backend, s in states.items():
        out = torch.empty_like(t["x"][:, 0])
        ys[backend] = ssd_step(s, t["x"][:, 0], t["dt"][:, 0], t["A"], t["B"][:, 0], t["C"][:, 0], D=t["D"], dt_bias=t["dt_bias"],
                               dt_softplus=True, dt_limit=(0.1, 3.0), out=out, backend=backend)
        assert ys[backend].data_ptr() == out.data_ptr()
    torch.testing.assert_close(ys["triton"].float(), ys["reference"].float(), rtol=tol, atol=tol)
    torch.testing.assert_close(states["triton"], states["reference"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_decode_step_continues_a_conv_and_scan_prefill(backend):
    """Prefill (conv1d + SSD) then mamba2_decode_step per token == the whole sequence at once."""
    gen = torch.Generator().manual_seed(3)
    batch, seq, heads, head_dim, groups, state, width = 2, 12, 4, 8, 2, 6, 4
    channels = heads * head_dim + 2 * groups * state
    xBC, dt = torch.randn(batch, seq, channels, generator=gen), torch.randn(batch, seq, heads, generator=gen)
    weight, bias = torch.randn(channels, width, generator=gen) * 0.5, torch.randn(channels, generator=gen)
    A, D, dt_bias = -torch.rand(heads, generator=gen) - 0.2, torch.randn(heads, generator=gen), torch.randn(heads, generator=gen)

    def split(conv):
        x, B, C = conv.split([heads * head_dim, groups * state, groups * state], -1)
        return x.unflatten(-1, (heads, head_dim)), B.unflatten(-1, (groups, state)), C.unflatten(-1, (groups, state))

    kw = dict(D=D, dt_bias=dt_bias, dt_softplus=True, backend=backend)
    x, B, C = split(causal_conv1d(xBC, weight, bias, activation="silu", backend=backend))
    full = ssd_scan(x, dt, A, B, C, **kw)
    conv, conv_state = causal_conv1d(xBC[:, :9], weight, bias, None, "silu", True, backend=backend)
    x, B, C = split(conv)
    prefix, ssm_state = ssd_scan(x, dt[:, :9], A, B, C, return_final_state=True, **kw)
    steps = [
        mamba2_decode_step(xBC[:, t], dt[:, t], conv_state, ssm_state, weight, bias, A, D=D, dt_bias=dt_bias, head_dim=head_dim,
                           backend=backend)
        for t in range(9, seq)
    ]
    torch.testing.assert_close(torch.cat([prefix, torch.stack(steps, 1)], 1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(dt=torch.randn(2, 21, 3)), "dt must be"),
        (dict(A=torch.randn(3)), "A must be"),
        (dict(B=torch.randn(2, 21, 3, 6), C=torch.randn(2, 21, 3, 6)), "groups"),
        (dict(C=torch.randn(2, 21, 2, 5)), "same shape"),
        (dict(initial_state=torch.randn(2, 4, 8, 5)), "initial_state must be"),
        (dict(dt_limit=(2.0, 1.0)), "dt_limit"),
        (dict(chunk_size=0), "chunk_size"),
    ],
)
def test_bad_arguments_name_the_parameter(change, match):
    with pytest.raises(ValueError, match=match):
        ssd_scan(**(inputs() | change))


def test_reference_memory_does_not_grow_with_chunks_times_tiles():
    """The reference's autograd graph keeps chunk inputs and entry states, not every chunk's [L, L]
    tile: the saved tensors of a 4096-token scan stay near the activations' own size."""
    t = inputs(batch=1, seq=4096, heads=2, head_dim=8, groups=1, state=8, initial=False)
    t["x"].requires_grad_()
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        ssd_scan(**t, dt_softplus=True, chunk_size=256, backend="reference")
    tiles = 4096 // 256 * 2 * 256 * 256 * 4  # every chunk's [heads, L, L] float32 tile
    assert sum(saved) < tiles / 4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_gpu_triton_matches_reference(dtype, tol):
    t = {k: (v.cuda() if v is not None else None) for k, v in inputs(seq=1000, heads=8, head_dim=64, groups=2, state=128, dtype=dtype).items()}
    leaves = {k: v.requires_grad_() for k, v in t.items()}
    results = {}
    for backend in ("reference", "triton"):
        y, final = ssd_scan(**t, dt_softplus=True, return_final_state=True, backend=backend)
        loss = y.float().square().mean() + final.square().mean()
        results[backend] = dict(y=y, final=final, **dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values())))))
    for name, ref in results["reference"].items():
        scale = ref.float().abs().max().clamp(min=1e-3)
        torch.testing.assert_close(results["triton"][name].float() / scale, ref.float() / scale, rtol=tol, atol=tol, msg=name)


@pytest.mark.gpu
def test_gpu_decode_step_replays_in_a_cuda_graph():
    """The decode step updates both states in place and reads no host values: captured once in a
    CUDA graph and replayed per token, it gives the eager steps' outputs and states."""
    gen = torch.Generator().manual_seed(4)
    batch, heads, head_dim, groups, state, width = 2, 8, 64, 2, 128, 4
    channels = heads * head_dim + 2 * groups * state
    cuda = lambda t: t.cuda()  # noqa: E731
    weight, bias = cuda(torch.randn(channels, width, generator=gen) * 0.5), cuda(torch.randn(channels, generator=gen))
    A, D, dt_bias = cuda(-torch.rand(heads, generator=gen) - 0.2), cuda(torch.randn(heads, generator=gen)), cuda(torch.randn(heads, generator=gen))
    xs, dts = cuda(torch.randn(5, batch, channels, generator=gen)), cuda(torch.randn(5, batch, heads, generator=gen))
    conv_state, ssm_state = cuda(torch.randn(batch, channels, width, generator=gen)), cuda(torch.randn(batch, heads, head_dim, state, generator=gen))
    conv_eager, ssm_eager = conv_state.clone(), ssm_state.clone()
    xBC, dt = xs[0].clone(), dts[0].clone()
    step = lambda x, t, c, s: mamba2_decode_step(x, t, c, s, weight, bias, A, D=D, dt_bias=dt_bias, head_dim=head_dim)  # noqa: E731

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile / warm up on copies, outside the capture
        step(xBC, dt, conv_state.clone(), ssm_state.clone())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = step(xBC, dt, conv_state, ssm_state)
    for t in range(5):
        xBC.copy_(xs[t])
        dt.copy_(dts[t])
        graph.replay()
        y_eager = step(xs[t], dts[t], conv_eager, ssm_eager)
        torch.testing.assert_close(y_graph, y_eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv_state, conv_eager)
    torch.testing.assert_close(ssm_state, ssm_eager, rtol=1e-5, atol=1e-5)
