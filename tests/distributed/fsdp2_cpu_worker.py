"""One rank of the CPU FSDP2 check (tests/distributed/test_fsdp2_cpu.py), started by torchrun:

    torchrun --standalone --nproc-per-node 2 tests/distributed/fsdp2_cpu_worker.py OUT_DIR [MODEL_TYPE ...]

For every tiny model type (tests/features/tiny_models.py): a plain model trained on the whole
global batch in this process (the one-process reference) and the same model under FSDP2 (gloo,
fully_shard over each DecoderLayer) trained on this rank's half of the batch, both float32 AdamW.
A sharded checkpoint (torch.distributed.checkpoint) of model and optimizer is saved mid-run and
loaded into a freshly built, differently initialised sharded model, which trains the remaining
steps again. The full state dict gathered at the end is loaded into a plain CPU model and saved
with save_pretrained. Rank 0 writes what the test compares to OUT_DIR/results.json.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "features"))
from tiny_models import MODEL_TYPES, random_ids, tiny_model  # noqa: E402

from gathered_weights import gathered_weights_checks  # noqa: E402

from hf_hybrid.distributed import shard_decoder_layers  # noqa: E402

STEPS = 3
CHECKPOINT_AFTER = 2  # steps done when the sharded checkpoint is written
GLOBAL_BATCH, SEQ = 4, 16
LEARNING_RATE = 1e-3


def batches(world_size: int, rank: int):
    """The global batch of every step, and this rank's contiguous share of it."""
    for step in range(STEPS):
        ids = random_ids(GLOBAL_BATCH, SEQ, seed=100 + step)
        share = GLOBAL_BATCH // world_size
        yield ids, ids[rank * share : (rank + 1) * share]


def train_steps(model, optimizer, inputs, reduce: bool, layer_calls: list | None = None) -> list[float]:
    """Train on ``inputs``; ``layer_calls`` gets, per step, how often the first DecoderLayer ran
    (once: one all-gather per layer, RAT+'s patterns stacked as row groups of one forward)."""
    losses = []
    for ids in inputs:
        calls = []
        hook = model.model.layers[0].register_forward_hook(lambda *args: calls.append(1))
        loss = model(input_ids=ids, labels=ids).loss
        hook.remove()
        if layer_calls is not None:
            layer_calls.append(len(calls))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        if reduce:  # every rank holds the same number of tokens: the mean of means is the global mean
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    return losses


def sharded_model(name: str, mesh, perturb: bool = False):
    model = tiny_model(name).train()
    if perturb:  # a model that only matches after the checkpoint is loaded into it
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.5)
    return shard_decoder_layers(model, mesh)


def check_model_type(name: str, mesh, out_dir: str) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    global_batches, local_batches = zip(*batches(world_size, rank))

    reference = tiny_model(name).train()
    reference_losses = train_steps(reference, torch.optim.AdamW(reference.parameters(), lr=LEARNING_RATE), global_batches, reduce=False)

    model = sharded_model(name, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    layer_calls: list[int] = []
    sharded_losses = train_steps(model, optimizer, local_batches[:CHECKPOINT_AFTER], reduce=True, layer_calls=layer_calls)
    checkpoint = os.path.join(out_dir, f"sharded-{name}")
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=checkpoint)
    sharded_losses += train_steps(model, optimizer, local_batches[CHECKPOINT_AFTER:], reduce=True)

    resumed = sharded_model(name, mesh, perturb=True)
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=LEARNING_RATE)
    model_state, optim_state = get_state_dict(resumed, resumed_optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=checkpoint)
    set_state_dict(resumed, resumed_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    resumed_losses = train_steps(resumed, resumed_optimizer, local_batches[CHECKPOINT_AFTER:], reduce=True)

    full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    result = {"reference_losses": reference_losses, "sharded_losses": sharded_losses, "resumed_losses": resumed_losses,
              "layer_calls_per_step": layer_calls}
    if rank == 0:
        checks, plain = gathered_weights_checks(full_state, reference, random_ids(2, SEQ, seed=7))
        result.update(checks)
        saved = os.path.join(out_dir, f"final-{name}")
        plain.save_pretrained(saved)
        reloaded = AutoModelForCausalLM.from_pretrained(saved).state_dict()
        result["reloaded_bit_exact"] = all(torch.equal(reloaded[key], value) for key, value in plain.state_dict().items())
    return result


def main() -> None:
    out_dir, names = sys.argv[1], sys.argv[2:] or list(MODEL_TYPES)
    hf_logging.disable_progress_bar()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = {name: check_model_type(name, mesh, out_dir) for name in names}
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "results.json"), "w") as file:
            json.dump(results, file, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
