"""The tile sweeps' choice of configuration (benchmarks/sweeps.py)."""
from benchmarks.sweeps import lowest_total


def test_lowest_total_over_complete_configs_within_the_error_bound():
    rows = [
        {"variant": "baseline", "us": 1.0},  # not a configuration
        {"config": [16, 2], "us": 5.0, "rel_error": 0.0}, {"config": [16, 2], "us": 5.0, "rel_error": 0.0},
        {"config": [64, 4], "us": 1.0, "rel_error": 0.0}, {"config": [64, 4], "us": 1.0, "rel_error": 0.5},  # too far
        {"config": [32, 2], "us": 2.0, "rel_error": 0.0},  # timed in one case only
        {"config": [32, 4], "error": "OutOfResources"}, {"config": [32, 4], "us": 4.0, "rel_error": 0.0},
        {"config": [8, 1], "us": 4.0, "rel_error": 1e-3}, {"config": [8, 1], "us": 5.0, "rel_error": 0.0},
    ]
    assert lowest_total(rows, "us", cases=2) == [8, 1]
