"""Multi-GPU training check (2 GPUs or more, from the repository root):

    python tests/gpu/multi_gpu_check.py OUT_DIR [--model-types rat,fox] [--engines fsdp2,zero3] [--nproc 2]

For every architecture, examples/train_multi_gpu.py trains 20 bf16 steps (4 layers, hidden 512,
1024 tokens a row, copy-task data) three ways at the same global batch: on one GPU (batch 2B), and
launched by accelerate on NPROC GPUs (batch B each) with FSDP2 (examples/accelerate/fsdp2.yaml) and
with DeepSpeed ZeRO-3 (examples/accelerate/zero3.yaml; needs the ``deepspeed`` package). Each
sharded run is resumed from its step-10 checkpoint, and every final checkpoint is loaded with
from_pretrained on CPU and on one GPU. Printed: a table per architecture and engine; the exit status
is 1 if any tolerance below is missed. Under FSDP2 and ZeRO-3, RAT+'s joint objective runs its two
patterns as row groups of one forward (hf_hybrid/models/rat_plus/stacked_patterns.py); one GPU
runs them one after the other (joint_objective.py): the same sum.

Tolerances (absolute, on losses near ln(512) = 6.2 at the start; RAT+'s joint loss is the sum of
two patterns' losses, near 12.5). The engines hand Trainer each rank's loss in bf16 (FSDP2's and
FSDP2 in bf16 does, through accelerate) and Trainer logs the mean over the ranks, so a logged
sharded loss is off by up to half a bf16 spacing at the loss (2^-6 = 0.016 near 6.2, 0.031 near
12.5): where an engine's logged losses all lie on that grid (``logged_in_bf16``), the step
tolerances against the float32 losses of one GPU below add that resolution; float32 logs get none.
- step 1, sharded vs one GPU computing in the same precision: 5e-3 (one forward of the same
  weights, rounded in a different order). One GPU runs twice for this: autocast over float32
  weights (Trainer's bf16=True) and bf16 weights without autocast (--bf16-weights, what ZeRO-3's
  bf16 mode computes); the engine's step 1 is compared with the nearer, both are in summary.json;
- every step of 20: 3e-2 (bf16 gradients reduced across GPUs round differently; AdamW carries the
  difference from step to step);
- resumed vs uninterrupted, steps 11-20: 5e-3 (same engine and numerics; only the order of
  atomic adds in bf16 backward kernels differs);
- final checkpoint, float32 evaluation loss on CPU vs on GPU: 2e-3 (reference kernels vs Triton);
- final checkpoint vs the one-GPU run's, evaluation loss: 3e-2.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_multi_gpu.py"
MODEL_TYPES = ["rat", "rat_plus", "fox", "rattention", "se_hybrid"]
SIZES = ["--hidden-size", "512", "--layers", "4", "--heads", "8", "--seq-len", "1024", "--vocab-size", "512",
         "--max-steps", "20", "--save-steps", "10", "--bf16"]
# Per architecture, what fits 1024-token rows (SE: one training chunk size, so nothing is drawn at random).
PER_TYPE = ["--set", "se_hybrid:attention_mode=se", "--set", "se_hybrid:se_chunk_sizes=[512]",
            "--set", "se_hybrid:se_eval_chunk_size=512", "--set", "rattention:window_size=256"]
TOL_FIRST, TOL_STEP, TOL_RESUME, TOL_CPU_GPU, TOL_FINAL = 5e-3, 3e-2, 5e-3, 2e-3, 3e-2


def bf16_resolution(loss: float) -> float:
    """Half the bf16 spacing at ``loss`` (8 significant bits): how far rounding moves it."""
    return 2.0 ** (math.floor(math.log2(abs(loss))) - 8)


def logged_in_bf16(losses: dict[int, float], nproc: int) -> bool:
    """Whether every logged loss is a mean of ``nproc`` bf16 numbers (a multiple of the bf16
    spacing / nproc), i.e. the engine returned each rank's loss in bf16."""
    return all(float(loss / (2 * bf16_resolution(loss) / nproc)).is_integer() for loss in losses.values())
RESUME_FROM = 10
LAUNCH_TIMEOUT_S = 420


def run(command: list[str], log: Path, env: dict | None = None) -> None:
    start = time.time()
    with open(log, "w") as out:
        done = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=LAUNCH_TIMEOUT_S)
    print(f"  {time.time() - start:5.0f} s  {' '.join(command[:6])} ... (log: {log})", flush=True)
    if done.returncode != 0:
        print(log.read_text()[-6000:])
        raise SystemExit(f"failed: {' '.join(command)}")


def launch(engine: str, nproc: int, model_types: list[str], out: Path, batch: int, extra: list[str], log: Path, port: int = 29500) -> None:
    args = [str(EXAMPLE), "--model-type", ",".join(model_types), "--batch-size", str(batch), "--output-dir", str(out), *SIZES, *PER_TYPE, *extra]
    if engine == "single":
        first_gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        run([sys.executable, *args], log, env=dict(os.environ, CUDA_VISIBLE_DEVICES=first_gpu))
    else:
        config = ROOT / "examples" / "accelerate" / f"{engine}.yaml"
        run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes", str(nproc),
             "--main_process_port", str(port), *args], log)


def losses(out: Path, model_type: str) -> dict[int, float]:
    summary = json.loads((out / model_type / "losses.json").read_text())
    return {int(step): loss for step, loss in summary["losses"].items()}


def evaluation_loss(path: Path, device: str) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(EXAMPLE.parent))
    from train_multi_gpu import CopyTaskData

    data = CopyTaskData(4, 1024, 512, seed=10_000)  # rows no run trained on
    ids = torch.stack([data[i]["input_ids"] for i in range(len(data))]).to(device)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--model-types", default=",".join(MODEL_TYPES))
    parser.add_argument("--engines", default="fsdp2,zero3")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4, help="rows per GPU in the sharded runs")
    parser.add_argument("--port", type=int, default=29500, help="accelerate's rendezvous port (one per concurrent check)")
    args = parser.parse_args()
    out = Path(args.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_types = args.model_types.split(",")
    engines = args.engines.split(",")
    started = time.time()

    print("training:", flush=True)
    launch("single", 1, model_types, out / "single", args.batch_size * args.nproc, [], out / "single.log")
    launch("single", 1, model_types, out / "single-bf16", args.batch_size * args.nproc, ["--bf16-weights", "--max-steps", "1"],
           out / "single-bf16.log")
    for engine in engines:
        launch(engine, args.nproc, model_types, out / engine, args.batch_size, [], out / f"{engine}.log", args.port)
        resume = str(out / engine / "{model_type}" / f"checkpoint-{RESUME_FROM}")
        launch(engine, args.nproc, model_types, out / f"{engine}-resumed", args.batch_size,
               ["--resume-from-checkpoint", resume], out / f"{engine}-resumed.log", args.port)

    import torch

    failures, rows = [], []
    single_final = {t: evaluation_loss(out / "single" / t / "final", "cuda:0") for t in model_types}
    for engine in engines:
        for model_type in model_types:
            reference, sharded = losses(out / "single", model_type), losses(out / engine, model_type)
            resumed = losses(out / f"{engine}-resumed", model_type)
            steps = sorted(reference)
            step_diffs = [abs(sharded[s] - reference[s]) for s in steps]
            # Step 1 is one forward of the same weights: it must equal one GPU computing in the same
            # precision, autocast over float32 weights or bf16 weights (whichever the engine uses).
            first_bf16 = losses(out / "single-bf16", model_type)[steps[0]]
            step1 = min(step_diffs[0], abs(sharded[steps[0]] - first_bf16))
            resume_diffs = [abs(resumed[s] - sharded[s]) for s in steps if s > RESUME_FROM]
            final = out / engine / model_type / "final"
            cpu_loss, gpu_loss = evaluation_loss(final, "cpu"), evaluation_loss(final, "cuda:0")
            row = {
                "engine": engine, "model_type": model_type, "steps": len(steps),
                "step1_diff": step1, "step1_vs_autocast": step_diffs[0], "step1_vs_bf16_weights": abs(sharded[steps[0]] - first_bf16), "max_step_diff": max(step_diffs), "max_resume_diff": max(resume_diffs),
                "final_cpu_vs_gpu": abs(cpu_loss - gpu_loss), "final_vs_single": abs(gpu_loss - single_final[model_type]),
                "first_loss": sharded[steps[0]], "last_loss": sharded[steps[-1]],
            }
            rows.append(row)
            resolution = bf16_resolution(reference[steps[0]]) if logged_in_bf16(sharded, args.nproc) else 0.0
            checks = [
                (len(steps) == 20 and sorted(sharded) == steps, "20 logged steps"),
                (row["step1_diff"] <= TOL_FIRST + resolution, f"step-1 |diff| <= {TOL_FIRST} + {resolution:.3g}"),
                (row["max_step_diff"] <= TOL_STEP + resolution, f"every step |diff| <= {TOL_STEP} + {resolution:.3g}"),
                (len(resume_diffs) == 20 - RESUME_FROM and row["max_resume_diff"] <= TOL_RESUME, f"resume |diff| <= {TOL_RESUME}"),
                (row["final_cpu_vs_gpu"] <= TOL_CPU_GPU, f"final CPU vs GPU <= {TOL_CPU_GPU}"),
                (row["final_vs_single"] <= TOL_FINAL, f"final vs one GPU <= {TOL_FINAL}"),
            ]
            failures += [f"{engine} {model_type}: {name}" for ok, name in checks if not ok]

    header = f"{'engine':<6} {'model':<11} {'step1':>9} {'max step':>9} {'resume':>9} {'cpu/gpu':>9} {'vs 1 GPU':>9} {'loss 1->20':>15}"
    print(f"\n{torch.cuda.get_device_name(0)} x {args.nproc}, {time.strftime('%Y-%m-%d')}, {time.time() - started:.0f} s in all")
    print(header)
    for r in rows:
        print(f"{r['engine']:<6} {r['model_type']:<11} {r['step1_diff']:9.2e} {r['max_step_diff']:9.2e} {r['max_resume_diff']:9.2e} "
              f"{r['final_cpu_vs_gpu']:9.2e} {r['final_vs_single']:9.2e} {r['first_loss']:7.3f}->{r['last_loss']:6.3f}")
    (out / "summary.json").write_text(json.dumps({"rows": rows, "failures": failures}, indent=1))
    print("\nFAILED:\n  " + "\n  ".join(failures) if failures else "\nall checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
