"""Train an hf-hybrid model on long rows with context parallelism composed with data parallelism:
a ``("dp", "cp")`` mesh, one long row per data-parallel rank split over that rank's ``cp`` ranks,
the model sharded by FSDP2 over dp x cp (``--fsdp``) or replicated with its gradients summed over
dp x cp (by ``DataContextMesh.all_reduce_gradients``, or torch's DDP with ``--ddp``). A plain training loop (no Trainer); copy-task rows generated in place (nothing downloaded).

    torchrun --standalone --nproc-per-node 4 examples/train_context_parallel.py --dp 2 --cp 2 --fsdp \\
        --model-type rat --seq-len 16384
    torchrun --standalone --nproc-per-node 2 examples/train_context_parallel.py --dp 1 --cp 2 --model-type fox
    torchrun --standalone --nproc-per-node 4 examples/train_context_parallel.py --dp 2 --cp 2 --device cpu --fp32 \\
        --model-type rat --hidden-size 32 --layers 2 --heads 4 --vocab-size 61 --seq-len 64    # CPU, gloo

Every step's global batch is ``dp`` rows of ``--seq-len`` tokens; rank (d, c) holds the c-th part of
row d. Each rank's loss is its share of the global mean (``num_items_in_batch`` counts the targets
of all dp x cp ranks), so the losses add up to the global mean and the gradients add up to its
gradient: forward, loss and gradients equal one process training on the whole global batch.
On GPUs the forward runs in bf16 (FSDP2: bf16 parameters, float32 gradient reduction; without
FSDP: autocast), on CPU in float32 with gloo.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

import hf_hybrid  # noqa: F401  (registers the architectures)
from hf_hybrid.cli import parse_overrides
from hf_hybrid.distributed import DataContextMesh, context_parallel, init_data_context_mesh


def copy_task_rows(step: int, rows: int, seq_len: int, vocab_size: int, seed: int) -> torch.Tensor:
    """[rows, seq_len] the global batch of ``step``: a random first half, then the same tokens again
    (the second half is predictable by looking back across the shards). The same in every process."""
    generator = torch.Generator().manual_seed(seed + 1000 * step)
    half = torch.randint(3, vocab_size, (rows, (seq_len + 1) // 2), generator=generator)
    return torch.cat([half, half], dim=1)[:, :seq_len]


def build_model(args) -> torch.nn.Module:
    config = AutoConfig.for_model(
        args.model_type, vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, intermediate_size=2 * args.hidden_size, pad_token_id=0,
        max_position_embeddings=max(4096, args.seq_len), **parse_overrides(args.set),
    )
    torch.manual_seed(args.seed)  # the same initial weights in every process
    return AutoModelForCausalLM.from_config(config)


def make_optimizer(args, model):
    if args.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=args.learning_rate)
    return torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)


def start_processes(device: str) -> torch.device:
    """The process group (NCCL on GPUs, gloo on CPU) and this process's device."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_mesh(args, device: torch.device) -> DataContextMesh:
    """The ("dp", "cp") mesh: torch's init_device_mesh, or (--mesh-from accelerate) the one
    accelerate builds from its ParallelismConfig (GPUs: accelerate refuses it on CPU processes).
    The model itself never goes through accelerator.prepare (see hf_hybrid/distributed/mesh.py)."""
    if args.mesh_from == "accelerate":
        from accelerate import Accelerator
        from accelerate.parallelism_config import ParallelismConfig

        accelerator = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=args.dp, cp_size=args.cp))
        return DataContextMesh.from_accelerate(accelerator)
    return init_data_context_mesh(args.dp, args.cp, device.type)


def train(args, model: torch.nn.Module | None = None, on_gradients=None, dims=None) -> list[float]:
    """Run ``args.steps`` optimizer steps; returns the global mean loss of every step.
    ``model``: a model to train instead of building one (the same on every rank);
    ``on_gradients(step, model)``: called with the reduced gradients, before the optimizer step;
    ``dims``: a DataContextMesh to reuse (else one is built from --dp and --cp)."""
    device = start_processes(args.device)
    dims = dims or build_mesh(args, device)
    cp = dims.cp
    model = (model if model is not None else build_model(args)).to(device).train()
    bf16 = device.type == "cuda" and not args.fp32
    trained = model
    loss_scale = 1
    if args.fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        dims.shard_model(model, mp_policy=policy)
    elif args.ddp:
        from torch.nn.parallel import DistributedDataParallel

        # DDP averages over the dp x cp ranks; the losses are shares of the global mean, whose
        # gradient is the sum: scale each share by the number of ranks.
        trained = DistributedDataParallel(model, process_group=dims.flat_group)
        loss_scale = dims.flat_mesh.size()
    optimizer = make_optimizer(args, model)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16 and not args.fsdp)

    losses = []
    for step in range(args.steps):
        row = copy_task_rows(step, args.dp, args.seq_len, args.vocab_size, args.seed)[dims.dp_rank : dims.dp_rank + 1]
        row = row.to(device)
        targets = cp.shard_labels(row)  # shifted over the whole row, then split: exact at the borders
        count = dims.count_targets(targets)  # over every dp x cp rank: each loss is a share of the global mean
        with context_parallel(model, cp):
            with autocast:
                loss = trained(input_ids=cp.shard(row), shift_labels=targets, num_items_in_batch=count, use_cache=False).loss
            (loss * loss_scale).backward()  # inside the block: a checkpointed layer's recompute exchanges again
        if not (args.fsdp or args.ddp):  # FSDP2's reduce-scatter / DDP's all-reduce already reduced over dp x cp
            dims.all_reduce_gradients(model)
        if on_gradients is not None:
            on_gradients(step, model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(dims.reduce_loss(loss).item())
        if dist.get_rank() == 0 and args.log:
            print(f"step {step + 1}: loss {losses[-1]:.4f}", flush=True)
    return losses


def parse_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=1, help="data-parallel ranks (one row each per step)")
    parser.add_argument("--cp", type=int, default=2, help="context-parallel ranks each row is split over")
    parser.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2 over dp x cp")
    parser.add_argument("--ddp", action="store_true",
                        help="replicate the model under torch's DistributedDataParallel over dp x cp (default: "
                             "replicated, gradients summed by DataContextMesh.all_reduce_gradients)")
    parser.add_argument("--mesh-from", choices=["torch", "accelerate"], default="torch",
                        help="build the mesh with torch's init_device_mesh or accelerate's ParallelismConfig")
    parser.add_argument("--model-type", default="rat")
    parser.add_argument("--seq-len", type=int, default=16384, help="tokens per row (a multiple of --cp)")
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--fp32", action="store_true", help="float32 on GPUs too (bf16 is the GPU default)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config fields")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="write the step losses to this JSON file (rank 0)")
    parser.add_argument("--quiet", dest="log", action="store_false", help="no per-step log")
    args = parser.parse_args(argv)
    if args.fsdp and args.ddp:
        parser.error("--fsdp and --ddp: pick one (FSDP2 shards, DDP replicates)")
    if args.seq_len % args.cp:
        parser.error(f"--seq-len {args.seq_len} must be a multiple of --cp {args.cp}")
    return args


def main(argv: list[str] | None = None) -> list[float]:
    args = parse_args(argv)
    losses = train(args)
    if dist.get_rank() == 0 and args.output:
        with open(args.output, "w") as file:
            json.dump({"dp": args.dp, "cp": args.cp, "fsdp": args.fsdp, "ddp": args.ddp, "model_type": args.model_type, "losses": losses}, file)
    dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
