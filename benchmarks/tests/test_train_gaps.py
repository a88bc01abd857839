"""benchmarks/train_gaps.py's accounting on a hand-made trace: device-side gaps, host-late gaps
charged to the innermost project frame around the launch (runtime and driver launches)."""
from benchmarks.train_gaps import gap_report


def _kernel(ts, dur, corr):
    return {"ph": "X", "cat": "kernel", "ts": ts, "dur": dur, "args": {"correlation": corr}, "name": f"k{corr}"}


def _launch(ts, corr, cat="cuda_runtime"):
    return {"ph": "X", "cat": cat, "ts": ts, "dur": 2, "args": {"correlation": corr}, "name": "launch"}


def test_gaps_are_split_into_host_late_and_device_side():
    events = [
        _kernel(0, 10, 1), _launch(0, 1),
        _kernel(15, 10, 2), _launch(5, 2),  # launched before k1 ended: a 5 us device-side gap
        _kernel(40, 10, 3), _launch(33, 3, "cuda_driver"),  # launched after k2 ended (25): host late, 15 us
        {"ph": "X", "cat": "python_function", "ts": 30, "dur": 10, "name": "hf_hybrid/layers/rat_attention.py(1): outer"},
        {"ph": "X", "cat": "python_function", "ts": 32, "dur": 4, "name": "kernels/chunk_attention/triton.py(2): inner"},
        {"ph": "X", "cat": "python_function", "ts": 32, "dur": 2, "name": "torch/nn/modules/module.py(3): not ours"},
    ]
    report = gap_report(events)
    assert report["kernels"] == 3 and report["kernel_ms"] == 30 / 1e3 and report["span_ms"] == 50 / 1e3
    assert report["device_side_ms"] == 5 / 1e3 and report["host_late_ms"] == 15 / 1e3
    assert report["by_frame"] == [("kernels/chunk_attention/triton.py(2): inner", 15 / 1e3, 1)]
