import json

from benchmarks.context_parallel_longest import Trial, next_length, report

GIB = 2**30


def test_doubles_while_the_extrapolated_peak_fits():
    trials = [Trial(1000, True, 1.0, 10 * GIB), Trial(2000, True, 2.0, 20 * GIB)]
    assert next_length(trials, 80 * GIB, 0.9, 6.0, 10**9) == 4000  # predicted 40 GiB
    trials.append(Trial(4000, True, 4.0, 40 * GIB))
    assert next_length(trials, 80 * GIB, 0.9, 6.0, 10**9) is None  # predicted 80 GiB > 72


def test_stops_after_a_failure_a_slow_step_or_the_cap():
    assert next_length([Trial(1000, False)], 80 * GIB, 0.9, 6.0, 10**9) is None
    assert next_length([Trial(1000, True, 7.0, GIB)], 80 * GIB, 0.9, 6.0, 10**9) is None
    assert next_length([Trial(1000, True, 1.0, GIB)], 80 * GIB, 0.9, 6.0, 1500) is None
    assert next_length([Trial(1000, True, 1.0, GIB)], 80 * GIB, 0.9, 6.0, 2000) == 2000


def test_report_gives_the_longest_length_per_gpu_count(tmp_path):
    path = tmp_path / "longest.jsonl"
    one = {"model": "RAT", "gpus": 1, "trials": [{"tokens": 1024, "ok": True, "step_s": 1.0, "peak_bytes": 1},
                                                 {"tokens": 2048, "ok": False, "step_s": 0.0, "peak_bytes": 0}]}
    two = {"model": "RAT", "gpus": 2, "trials": [{"tokens": 2048, "ok": True, "step_s": 1.25, "peak_bytes": 1}]}
    fox = {"model": "FoX", "gpus": 2, "trials": [{"tokens": 2048, "ok": False, "step_s": 0.0, "peak_bytes": 0}]}
    path.write_text("".join(json.dumps(r) + "\n" for r in (one, two, fox)))
    table = report(str(path))
    assert "| RAT | 1,024 (1.00 s) | 2,048 (1.25 s) |" in table
    assert "| FoX | - | - |" in table
