"""benchmarks/context_parallel_scaling.py's CPU path: two gloo ranks time FoX's one-rank step and
its split step at the tiny shape under both layouts, and rank 0 writes a row per layout with both
throughputs and their ratio."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "context_parallel_scaling.py"


def test_two_cpu_ranks_report_the_ratio(tmp_path):
    # Launched by path from tmp_path: neither the repository root (its kernels/ folder) nor
    # benchmarks/ (its profile.py) goes on the ranks' sys.path.
    launcher = tmp_path / "launch.py"
    launcher.write_text(
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('context_parallel_scaling', {str(SCRIPT)!r})\n"
        "module = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(module)\nsys.exit(module.main())\n"
    )
    out = tmp_path / "rows.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(launcher),
               "--device", "cpu", "--quick", "--seq", "16", "--repeat", "1", "--only", "FoX (pro)", "--json", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(out.read_text())
    assert [row["layout"] for row in rows] == ["contiguous", "balanced"]  # a row per layout by default
    for row in rows:
        assert row["name"] == "FoX (pro)" and row["ranks"] == 2 and row["seq_per_rank"] == 16
        assert row["one_gpu_tokens_per_s"] > 0 and row["split_tokens_per_s_per_gpu"] > 0
        assert abs(row["ratio"] - row["one_gpu_s"] / row["split_s"]) < 1e-9
    assert "2 ranks x 16 tokens" in done.stdout
