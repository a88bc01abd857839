"""The first-use GPU check's own path at CPU size (tests/gpu/first_use_check.py, run by
tests/gpu/test_first_use_gpu.py): it builds the architecture's bench row, times a first and a second
call, records Triton's compiles through hooks it removes again, and writes its JSON."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

CHECK = Path(__file__).resolve().parent / "gpu" / "first_use_check.py"


def _check_module():
    module = sys.modules.get("first_use_check")
    if module is None:
        spec = importlib.util.spec_from_file_location("first_use_check", CHECK)
        module = importlib.util.module_from_spec(spec)
        sys.modules["first_use_check"] = module
        spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("model_type,mode", [("rat", "train"), ("fox", "generate")])
def test_tiny_first_use_writes_its_times_and_leaves_triton_as_it_was(model_type, mode, tmp_path):
    from triton.runtime import autotuner, jit

    check = _check_module()
    before = (jit.JITFunction._do_compile, autotuner.Autotuner.run)
    out = tmp_path / "result.json"
    assert check.main(["--arch", model_type, "--mode", mode, "--out", str(out), "--tiny", "--device", "cpu"]) == 0
    result = json.loads(out.read_text())
    assert result["arch"] == model_type and result["mode"] == mode
    assert result["first_s"] > 0 and result["second_s"] > 0
    assert result["tokens"] == (check.TINY_TRAIN_TOKENS if mode == "train" else check.TINY_PROMPT)
    assert result["new_tokens"] == (check.NEW_TOKENS if mode == "generate" else 0)
    assert set(result["hooked"]) == {"JITFunction._do_compile", "Autotuner.run"}
    assert result["triton_compiles"] == 0 and result["compiles"] == []  # the CPU path runs the references
    assert isinstance(result["torch_compile"], dict)
    if mode == "train":
        assert 0 < result["first_forward_s"] and result["first_forward_s"] + result["first_backward_s"] == pytest.approx(
            result["first_s"], abs=2e-3)
    assert (jit.JITFunction._do_compile, autotuner.Autotuner.run) == before


def test_fox_portable_run_holds_the_hopper_kernels_off_only_for_the_run(tmp_path):
    from hf_hybrid.kernels.forgetting_attention import triton as fa_triton

    check = _check_module()
    before = (fa_triton.hopper_forward_applies, fa_triton.hopper_backward_applies)
    out = tmp_path / "result.json"
    assert check.main(["--arch", "fox", "--mode", "train", "--out", str(out), "--tiny", "--device", "cpu",
                       "--fox-portable"]) == 0
    result = json.loads(out.read_text())
    assert result["fox_portable"] is True and result["arch"] == "fox" and result["autotune"] == []
    assert (fa_triton.hopper_forward_applies, fa_triton.hopper_backward_applies) == before


def test_compile_log_times_each_compile_by_kernel_and_constexprs():
    """The hook around JITFunction._do_compile, driven by a stand-in for Triton's compile."""
    from triton.runtime import jit

    check = _check_module()

    class Param:
        def __init__(self, name):
            self.name = name

    def example_kernel():  # stands for the kernel's Python function
        pass

    example_kernel.__module__ = "ops.example"

    class Kernel:
        params = [Param("X"), Param("BLOCK")]
        fn = staticmethod(example_kernel)

    kernel = Kernel()
    original = jit.JITFunction._do_compile
    jit.JITFunction._do_compile = lambda self, *args, **kwargs: "compiled"
    try:
        log = check.CompileLog().install()
        try:
            assert jit.JITFunction._do_compile(kernel, "key", {}, 0, {(1,): 64}, None, {}, False) == "compiled"
            jit.JITFunction._do_compile(kernel, "key", {}, 0, {(1,): 128}, None, {}, False)
        finally:
            log.uninstall()
        assert jit.JITFunction._do_compile is not original  # the stand-in is back, not Triton's
    finally:
        jit.JITFunction._do_compile = original
    report = log.report()
    assert report["triton_compiles"] == 2
    [entry] = report["compiles"]
    assert entry["count"] == 2 and entry["variants"] == ["BLOCK=64", "BLOCK=128"]
    assert entry["kernel"] == "ops.example.example_kernel" and entry["seconds"] >= 0


def test_the_gpu_tests_subprocess_and_summary_at_cpu_size(tmp_path):
    """tests/gpu/test_first_use_gpu.py's plumbing (fresh process, empty caches, JSON, the printed line)
    on the CPU-sized run, so that its one GPU run does not fail on it."""
    spec = importlib.util.spec_from_file_location("first_use_gpu", CHECK.with_name("test_first_use_gpu.py"))
    gpu_test = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_test)
    result = gpu_test.first_use("rat", "train", tmp_path, tmp_path, extra=("--tiny", "--device", "cpu"))
    assert (tmp_path / "first_use_rat_train.json").exists()
    line = gpu_test._summary(result)
    assert line.startswith("RAT train: first ") and "forward" in line and "Triton compiles 0.0 s (0)" in line
    busy = dict(result, compiles=[{"kernel": "hf_hybrid.kernels.x._fwd_kernel", "seconds": 3.21, "count": 2}],
                autotune=[{"kernel": "hf_hybrid.kernels.y._dq_kernel", "seconds": 9.5}], triton_compile_s=3.21,
                triton_compiles=2, torch_compile={"compile_fx_inner": 4.0, "_compile.compile_inner": 6.5})
    line = gpu_test._summary(busy)
    assert "_fwd_kernel 3.2s x2" in line and "autotuned: _dq_kernel 9.5s" in line and "torch.compile 6.5 s" in line
