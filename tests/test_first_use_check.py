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
    assert (jit.JITFunction._do_compile, autotuner.Autotuner.run) == before


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
