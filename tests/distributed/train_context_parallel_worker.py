"""One rank of the CPU check of examples/train_context_parallel.py (test_train_context_parallel_cpu.py):

    torchrun --standalone --nproc-per-node 4 tests/distributed/train_context_parallel_worker.py OUT_DIR [MODEL_TYPE ...]

4 gloo ranks as dp=2 x cp=2. Per tiny model type (float32, reference kernels): one process trains
the whole global batch (2 rows) for 2 SGD steps (the reference, run on every rank); then the
example's loop trains the same model split over the mesh: under FSDP2 over dp x cp, replicated
with its gradients summed over dp x cp, and under torch's DDP over dp x cp (loss scaled by 4). Compared with the reference: every step's loss,
every step's full gradients (gathered from the FSDP shards) and the parameters after the last
step. The replicated runs use the mesh accelerate's ``ParallelismConfig(dp_shard_size=2,
cp_size=2)`` builds, read by ``DataContextMesh.from_accelerate``; the FSDP2 runs the one
``init_data_context_mesh`` builds (which refuses a dp x cp other than the number of processes). The coalesced gradient all-reduce is also compared
with one all-reduce per tensor (to rounding). Rank 0 writes the largest differences over all ranks to
OUT_DIR/results.json.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "features"))
from tiny_models import VOCAB, tiny_model  # noqa: E402

from hf_hybrid.distributed import DataContextMesh, init_data_context_mesh  # noqa: E402
from hf_hybrid.distributed.gradients import all_reduce_coalesced  # noqa: E402

EXAMPLE = HERE.parents[1] / "examples" / "train_context_parallel.py"
DP, CP, STEPS, SEQ = 2, 2, 2, 32
ARGS = ["--dp", str(DP), "--cp", str(CP), "--device", "cpu", "--fp32", "--seq-len", str(SEQ), "--steps", str(STEPS),
        "--optimizer", "sgd", "--learning-rate", "0.1", "--vocab-size", str(VOCAB), "--quiet"]


def load_example():
    spec = importlib.util.spec_from_file_location("train_context_parallel", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A full tensor from an FSDP2 shard (collective), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


# SE retrieval picks its top-k blocks by score: a discrete choice, which a float32 rounding-level
# difference in the weights after a step (the split runs sum their gradients in another order)
# can flip at a near-tie, in one run and not the other. Retrieving every block (top-k >= the blocks
# of 32 tokens) keeps the SE retrieval path with no choice to flip; the choice itself, at fixed
# weights, is checked by test_context_parallel_cpu.py (se_hybrid, top-k 2).
OVERRIDES = {"se_hybrid": {"se_top_k": SEQ // 2}}


def model_of(name: str):
    return tiny_model(name, kernel_backend="reference", **OVERRIDES.get(name, {})).train()


def reference_run(example, args, name: str) -> dict:
    model = model_of(name)
    optimizer = example.make_optimizer(args, model)
    losses, grads = [], []
    for step in range(STEPS):
        rows = example.copy_task_rows(step, DP, SEQ, VOCAB, args.seed)
        loss = model(input_ids=rows, labels=rows, use_cache=False).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def split_run(example, args, name: str, dims, reference: dict) -> dict:
    model = model_of(name)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = []

    def record(step, trained):
        grads.append({n: whole(p.grad).clone() for n, p in trained.named_parameters() if p.grad is not None})

    losses = example.train(args, model=model, on_gradients=record, dims=dims)
    params = {n: whole(p.detach()) for n, p in model.named_parameters()}
    missing = sorted({n for step in range(STEPS) for n in set(grads[step]) ^ set(reference["grads"][step])})
    diffs = torch.tensor([
        max(abs(a - b) for a, b in zip(losses, reference["losses"])),
        *[max((g - reference["grads"][step][n]).abs().max().item() for n, g in grads[step].items() if n in reference["grads"][step])
          for step in range(STEPS)],
        max(g.abs().max().item() for step in range(STEPS) for g in reference["grads"][step].values()),
        max((p - reference["params"][n]).abs().max().item() for n, p in params.items()),
        max((p - initial[n]).abs().max().item() for n, p in params.items()),
    ], dtype=torch.float64)
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    loss_diff, *grad_diffs, grad_scale, param_diff, moved = diffs.tolist()
    return {"loss_diff": loss_diff, "grad_diffs": grad_diffs, "grad_scale": grad_scale,
            "param_diff": param_diff, "moved": moved, "missing_grads": missing,
            "losses": losses, "reference_losses": reference["losses"]}


def coalesced_matches_per_tensor() -> bool:
    """Tensors of two dtypes, odd shapes and a bucket smaller than some of them: the bucketed sum
    equals one all-reduce per tensor on every rank, to rounding (gloo splits a buffer over the
    ranks by its length, so the order of the sum can differ)."""
    generator = torch.Generator().manual_seed(dist.get_rank())
    shapes = [(3, 5), (7,), (64, 9), (1,), (2, 2, 2)]
    tensors = [torch.randn(s, generator=generator, dtype=dtype) for s in shapes for dtype in (torch.float32, torch.float64)]
    expected = [t.clone() for t in tensors]
    for t in expected:
        dist.all_reduce(t)
    all_reduce_coalesced(tensors, bucket_bytes=256)
    same = torch.tensor(int(all(torch.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(tensors, expected))))
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())


def main() -> None:
    out_dir, names = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    example = load_example()
    args = example.parse_args(ARGS)
    fsdp_args = example.parse_args([*ARGS, "--fsdp"])
    ddp_args = example.parse_args([*ARGS, "--ddp"])

    from accelerate.parallelism_config import ParallelismConfig

    own = init_data_context_mesh(DP, CP, "cpu")
    accelerate = DataContextMesh.from_accelerate(ParallelismConfig(dp_shard_size=DP, cp_size=CP).build_device_mesh("cpu"))
    layout = [(own.dp_rank, own.cp.rank), (accelerate.dp_rank, accelerate.cp.rank)]
    results = {
        "accelerate_layout_matches": layout[0] == layout[1] and accelerate.dp_size == own.dp_size == DP,
        "dp_rank_and_cp_rank": layout[0] == (dist.get_rank() // CP, dist.get_rank() % CP),
        "coalesced_matches_per_tensor": coalesced_matches_per_tensor(),
    }
    try:
        init_data_context_mesh(3, 1, "cpu")
        results["wrong_size_refused"] = False
    except ValueError as error:
        results["wrong_size_refused"] = "launch dp * cp processes" in str(error)
    checks = torch.tensor([int(results["accelerate_layout_matches"]), int(results["dp_rank_and_cp_rank"])])
    dist.all_reduce(checks, op=dist.ReduceOp.MIN)
    results["accelerate_layout_matches"], results["dp_rank_and_cp_rank"] = (bool(c) for c in checks.tolist())
    for name in names:
        reference = reference_run(example, args, name)
        results[name] = {
            "fsdp": split_run(example, fsdp_args, name, own, reference),
            "plain": split_run(example, args, name, accelerate, reference),
            "ddp": split_run(example, ddp_args, name, own, reference),
        }
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "results.json"), "w") as file:
            json.dump(results, file, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
