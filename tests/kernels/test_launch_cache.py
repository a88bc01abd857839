"""hf_hybrid/_compat/triton_launch.py: launches through the compiled kernel's own launcher, keyed by what Triton
specialises on. The key is checked everywhere; the launches themselves on a GPU (the CPU
interpreter has no compiled kernels: there the decorator returns the JIT function unchanged)."""
import pytest
import torch
import triton
import triton.language as tl

from hf_hybrid._compat import triton_launch as _launch
from hf_hybrid._compat.triton_launch import CachedLaunchKernel, _arg_key, _args_key, _Unsupported, launch_cached


@launch_cached
@triton.jit
def _scaled_copy_kernel(X, Y, n, stride, scale, BLOCK: tl.constexpr, ADD_ONE: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs * stride, mask=offs < n, other=0.0)
    y = x * scale
    if ADD_ONE:
        y += 1.0
    tl.store(Y + offs, y, mask=offs < n)


def test_the_key_holds_what_triton_specialises_on():
    base = torch.zeros(64)
    assert _arg_key(base) == (torch.float32, True)
    assert _arg_key(base[1:]) == (torch.float32, False)  # 4 bytes past a 16-byte boundary
    assert _arg_key(base.to(torch.bfloat16)) != _arg_key(base)
    assert _arg_key(1) != _arg_key(2) != _arg_key(32) != _arg_key(2**40)  # == 1, % 16, 32 / 64 bits
    assert _arg_key(2**63 + 16) != _arg_key(2**40)  # u64
    assert _arg_key(3) == _arg_key(5)  # neither 1 nor divisible by 16: one kernel
    assert _arg_key(0.5) == _arg_key(2.0)  # non-constexpr floats are not specialised
    assert _arg_key(True) != _arg_key(1) and _arg_key(None) == (type(None), None)
    with pytest.raises(_Unsupported):
        _arg_key((1, 2))


def test_the_inlined_key_of_all_arguments_is_the_per_argument_key():
    base = torch.zeros(64)
    args = (base, base[1:], torch.nn.Parameter(base), 1, 2, 32, 2**40, 2**63 + 16, -7, 0.5, True, None, torch.float16, "s")
    assert _args_key(args) == tuple(map(_arg_key, args))
    with pytest.raises(_Unsupported):
        _args_key((base, (1, 2)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's case")
def test_interpreter_keeps_the_jit_function():
    assert not isinstance(_scaled_copy_kernel, CachedLaunchKernel)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need a GPU")


def _run(x, n, stride, scale, **constexprs):
    y = torch.zeros(n, device=x.device)
    _scaled_copy_kernel[(triton.cdiv(n, 32),)](x, y, n, stride, scale, BLOCK=32, **constexprs)
    return y


@cuda
@pytest.mark.gpu
def test_cached_launches_compute_what_triton_launches_compute():
    assert isinstance(_scaled_copy_kernel, CachedLaunchKernel)
    x = torch.randn(400, device="cuda")
    cases = [  # aligned and not, stride 1 (specialised) and not, a constexpr default and not
        (x, 100, 1, 2.0, {}), (x[1:], 100, 1, 2.0, {}), (x, 100, 3, 0.5, {}), (x[3:], 33, 3, -1.0, {"ADD_ONE": True}),
        (x, 96, 2, 1.5, {"ADD_ONE": False}), (x[1:], 17, 16, 3.0, {}),
    ]
    for _ in range(2):  # the first round fills the cache through Triton, the second launches directly
        for source, n, stride, scale, constexprs in cases:
            want = source[: n * stride : stride] * scale + (1.0 if constexprs.get("ADD_ONE") else 0.0)
            torch.testing.assert_close(_run(source, n, stride, scale, **constexprs), want)
    kept = {id(kernel) for kernel, _ in _scaled_copy_kernel._compiled.values()}
    tritons = {id(kernel) for kernel in _scaled_copy_kernel.jit_function.device_caches[torch.cuda.current_device()][0].values()}
    assert kept <= tritons and len(kept) >= 4  # Triton's own kernels; alignment and stride 1 split them


@cuda
@pytest.mark.gpu
def test_launch_hooks_and_the_switch_take_tritons_path(monkeypatch):
    from triton import knobs

    x = torch.randn(64, device="cuda")
    _run(x, 64, 1, 2.0)  # cached
    seen = []
    hook = lambda metadata: seen.append(metadata)  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        torch.testing.assert_close(_run(x, 64, 1, 2.0), x * 2)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert seen, "a launch hook must see the launch (Triton's path)"
    monkeypatch.setenv("HF_HYBRID_TRITON_FAST_LAUNCH", "0")
    assert not _launch._enabled() and launch_cached(_scaled_copy_kernel.jit_function) is _scaled_copy_kernel.jit_function


def test_other_triton_versions_take_tritons_own_path(monkeypatch):
    """The fast path reads Triton internals: only the versions it was checked against use it."""
    assert _launch.triton_checked("3.6.0") and _launch.triton_checked("3.4.1")
    assert not _launch.triton_checked("3.7.0") and not _launch.triton_checked("2.3.1")
    assert not _launch.triton_checked("not-a-version")
    from triton.runtime.jit import JITFunction

    kernel = _scaled_copy_kernel.jit_function if isinstance(_scaled_copy_kernel, CachedLaunchKernel) else _scaled_copy_kernel
    monkeypatch.setattr(_launch, "triton_checked", lambda version=None: False)
    assert launch_cached(kernel) is kernel
    if isinstance(kernel, JITFunction):
        monkeypatch.setattr(_launch, "triton_checked", lambda version=None: True)
        assert isinstance(launch_cached(kernel), CachedLaunchKernel)
