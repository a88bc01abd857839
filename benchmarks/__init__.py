"""One-off diagnostics, sweeps and A/B scripts of hf-hybrid's development (not installed).

Run from the repository root as ``python -m benchmarks.<name>``; README.md lists them. The
user-facing comparisons are the installed ``hf-hybrid bench`` suites (hf_hybrid/bench/).
"""
