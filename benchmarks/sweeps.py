"""What the tile sweeps (split_decode_sweep, rat_decode_sweep, few_row_sweep) share: picking the
configuration to ship, writing the result, and operands that are read from memory when timed."""
from __future__ import annotations

import json


def lowest_total(rows: list[dict], time_key: str, cases: int, max_error: float = 1e-2) -> list:
    """The ``config`` of rows with the lowest time summed over all ``cases``, among configurations
    timed in every case and within ``max_error`` (``rel_error``) in each."""
    totals: dict[tuple, list[float]] = {}
    too_far = set()
    for row in rows:
        if "config" in row and time_key in row:
            totals.setdefault(tuple(row["config"]), []).append(row[time_key])
            if row["rel_error"] > max_error:
                too_far.add(tuple(row["config"]))
    complete = [c for c, times in totals.items() if len(times) == cases and c not in too_far]
    return list(min(complete, key=lambda c: sum(totals[c])))


def write_json(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


COLD_BYTES = 256 << 20  # several times the H200's 50 MB L2


def cold_copies(first, nbytes: int, copy) -> list:
    """``first`` and enough copies of it (``copy(first)``) that one pass over them reads at least
    COLD_BYTES of ``nbytes`` each: timed in turn, every copy is read from memory, as in a model's
    step, not from the L2 a replay of one small operand would stay in."""
    return [first] + [copy(first) for _ in range(-(-COLD_BYTES // nbytes) - 1)]
