"""The peak-memory report (benchmarks/peak_memory.py) replays an allocator trace correctly:
the peak is the largest sum of live blocks, and the blocks alive then are grouped by their site."""
from __future__ import annotations

from benchmarks.peak_memory import peak_of_trace


def _frames(file: str, line: int, name: str = "forward"):
    return [{"filename": "/usr/lib/python3/site-packages/torch/autograd/function.py", "line": 1, "name": "apply"},
            {"filename": f"/src/hf_hybrid/layers/{file}", "line": line, "name": name}]


def test_peak_is_the_largest_live_sum_and_groups_its_blocks():
    trace = [
        {"action": "alloc", "addr": 0, "size": 100, "frames": _frames("a.py", 1)},
        {"action": "alloc", "addr": 1, "size": 50, "frames": _frames("a.py", 1)},
        {"action": "alloc", "addr": 2, "size": 30, "frames": _frames("b.py", 7)},  # peak: 180
        {"action": "free_requested", "addr": 0, "size": 100},
        {"action": "free_completed", "addr": 0, "size": 100},
        {"action": "alloc", "addr": 3, "size": 120, "frames": _frames("c.py", 2, "backward")},  # 200 > 180
        {"action": "free_completed", "addr": 3, "size": 120},
        {"action": "alloc", "addr": 4, "size": 10, "frames": []},
    ]
    report = peak_of_trace(trace, before_bytes=1000)
    assert report.peak_bytes == 1000 + 200
    assert report.phase == "backward"
    sites = {site.split(" ")[0]: (nbytes, count) for site, nbytes, count in report.groups}
    assert sites == {"hf_hybrid/layers/c.py:2": (120, 1), "hf_hybrid/layers/a.py:1": (50, 1),
                     "hf_hybrid/layers/b.py:7": (30, 1)}
    assert [g[1] for g in report.groups] == [120, 50, 30]
    assert "0.000" in report.text(rows=2) and "reached in the backward" in report.text(rows=2)
