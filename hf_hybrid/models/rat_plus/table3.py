"""Moved: the RAT+ Table 3 reproduction lives in :mod:`hf_hybrid.reproduce.rat_plus`.

``hf-hybrid reproduce rat_plus --preset cpu|gpu --out DIR`` runs it with several seeds and writes the
Markdown/PNG/JSON report; this alias keeps the original one-seed CLI working:

    python -m hf_hybrid.models.rat_plus.table3 --preset gpu --time-budget 200 --out DIR
"""
from __future__ import annotations


def main(argv=None) -> None:
    from ...reproduce.rat_plus import main as reproduce_main  # imported late: reproduce sits above models

    reproduce_main(argv)


if __name__ == "__main__":
    main()
