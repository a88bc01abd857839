"""project_shared_input == calling the nn.Linear modules one by one: same outputs, same gradients of
the input and of every weight (the input gradient summed by addmm instead of autograd's adds), and
the modules' own forward wherever that would not be F.linear (hooks, wrappers, no gradient)."""
import pytest
import torch
from torch import nn

from hf_hybrid.layers.projections import _SharedInputLinear, project_shared_input


def _projections(seed=0):
    torch.manual_seed(seed)
    return (nn.Linear(12, 8, bias=False), nn.Linear(12, 4, bias=False), nn.Linear(12, 8, bias=False))


def _grads(outputs, x, projections, weights):
    loss = sum((o * w).sum() for o, w in zip(outputs, weights) if w is not None)
    return torch.autograd.grad(loss, [x] + [p.weight for p in projections], allow_unused=True)


@pytest.mark.parametrize("use", [(True, True, True), (True, False, True)])
def test_same_outputs_and_gradients_as_the_modules(use):
    projections = _projections()
    x = torch.randn(2, 5, 12, requires_grad=True)
    weights = [torch.randn(2, 5, p.out_features) if used else None for p, used in zip(projections, use)]
    fused = project_shared_input(x, projections)
    plain = tuple(p(x) for p in projections)
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)
    assert fused[0].grad_fn.name().startswith("_SharedInputLinear")
    got, want = _grads(fused, x, projections, weights), _grads(plain, x, projections, weights)
    for a, b in zip(got, want):
        if b is None:  # an unused output: no gradient for its weight either way
            assert a is None
        else:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_input_without_gradient_gives_weight_gradients_only():
    projections = _projections()
    x = torch.randn(3, 12)
    outputs = _SharedInputLinear.apply(x, *(p.weight for p in projections))
    grads = torch.autograd.grad(sum(o.sum() for o in outputs), [p.weight for p in projections])
    for p, g in zip(projections, grads):
        torch.testing.assert_close(g, torch.ones(3, p.out_features).t() @ x)


def test_modules_are_called_when_their_forward_is_not_plain_linear():
    projections = _projections()
    x = torch.randn(2, 12, requires_grad=True)
    calls = []
    projections[1].register_forward_hook(lambda module, args, out: calls.append(module))
    outputs = project_shared_input(x, projections)
    assert calls == [projections[1]] and outputs[0].grad_fn.name() == "MmBackward0"
    with_bias = (nn.Linear(12, 3), nn.Linear(12, 3, bias=False))
    assert torch.equal(project_shared_input(x, with_bias)[0], with_bias[0](x))
    with torch.no_grad():  # inference: the plain modules (nothing to sum)
        assert project_shared_input(x, _projections())[0].grad_fn is None


def test_autocast_takes_the_modules_path_with_consistent_dtypes():
    """Under autocast (Trainer's bf16=True) the projections run as modules: the summed-gradient
    Function would mix autocast's bf16 gradients with its saved fp32 weights in the backward."""
    from hf_hybrid.layers.projections import project_shared_input

    torch.manual_seed(0)
    projections = tuple(torch.nn.Linear(16, 8, bias=False) for _ in range(3))
    x = torch.randn(2, 5, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = project_shared_input(x, projections)
        assert all(o.dtype == torch.bfloat16 for o in outs)
        sum(o.float().sum() for o in outs).backward()
    assert x.grad.dtype == torch.float32 and all(p.weight.grad.dtype == torch.float32 for p in projections)


# ----------------------------------------------------------------------------- few-row projections
from hf_hybrid.kernels._backend import triton_interpreting  # noqa: E402
from hf_hybrid.layers import projections as projections_module  # noqa: E402
from hf_hybrid.layers.projections import project_few_rows  # noqa: E402

needs_kernel = pytest.mark.skipif(not (torch.cuda.is_available() or triton_interpreting()),
                                  reason="needs CUDA or TRITON_INTERPRET=1")


def _count_kernel_calls(monkeypatch) -> list:
    calls = []
    original = projections_module.few_row_linear
    monkeypatch.setattr(projections_module, "few_row_linear", lambda *a: calls.append(len(a[1])) or original(*a))
    monkeypatch.setattr(projections_module, "FEW_ROW_BACKEND", "triton")
    return calls


@needs_kernel
def test_few_rows_without_gradient_run_the_kernel_once_for_all_projections(monkeypatch):
    calls = _count_kernel_calls(monkeypatch)
    projections = _projections()
    x = torch.randn(3, 1, 12)
    with torch.no_grad():
        got = project_few_rows(x, projections)
        single = project_few_rows(x, projections[1:2])
    assert calls == [3]  # one launch for the three weights; a single weight stays with the module (cuBLAS)
    for a, p in zip(got, projections):
        torch.testing.assert_close(a, p(x), rtol=1e-5, atol=1e-6)
    assert torch.equal(single[0], projections[1](x))


@needs_kernel
def test_few_rows_keep_the_modules_for_gradients_many_rows_and_wrapped_modules(monkeypatch):
    calls = _count_kernel_calls(monkeypatch)
    projections = _projections()
    x = torch.randn(2, 1, 12, requires_grad=True)
    assert all(torch.equal(a, p(x)) for a, p in zip(project_few_rows(x, projections), projections))  # recording
    with torch.no_grad():
        many = torch.randn(2, 40, 12)  # 80 rows: past the kernel's few
        assert all(torch.equal(a, p(many)) for a, p in zip(project_few_rows(many, projections), projections))
        projections[0].register_forward_hook(lambda module, args, out: out * 2)  # a hook: its module's own forward
        hooked = project_few_rows(x.detach(), projections)
        assert torch.equal(hooked[0], 2 * (x.detach() @ projections[0].weight.t()))
    assert calls == []
