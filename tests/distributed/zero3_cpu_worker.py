"""One rank of the CPU DeepSpeed ZeRO-3 check (tests/distributed/test_zero3_cpu.py), started by torchrun:

    torchrun --standalone --nproc-per-node 2 tests/distributed/zero3_cpu_worker.py OUT_DIR [MODEL_TYPE ...]

As fsdp2_cpu_worker.py, under ZeRO-3 (gloo, float32, each DecoderLayer one gather unit through
hf_hybrid.distributed.gather_whole_decoder_layers): per tiny model type, the losses of a plain
model on the whole global batch and of the ZeRO-3 engine on this rank's half; a DeepSpeed
checkpoint written mid-run and loaded into a fresh, differently initialised engine; the final
weights gathered (``_zero3_consolidated_16bit_state_dict``, float32 here) and loaded into a plain
CPU model. Rank 0 writes OUT_DIR/results.json.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from transformers.utils import logging as hf_logging

import deepspeed

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "features"))
from tiny_models import MODEL_TYPES, random_ids, tiny_model  # noqa: E402

from gathered_weights import gathered_weights_checks  # noqa: E402

from hf_hybrid.distributed import gather_whole_decoder_layers  # noqa: E402

STEPS, CHECKPOINT_AFTER = 3, 2
GLOBAL_BATCH, SEQ = 4, 16
LEARNING_RATE = 1e-3
# float32, no clipping (DeepSpeed clips at 1.0 unless told), the client's AdamW on the partitions.
CONFIG = {
    "train_micro_batch_size_per_gpu": GLOBAL_BATCH // 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_gather_16bit_weights_on_model_save": True},
    "zero_allow_untested_optimizer": True,
}


def engine_for(name: str, perturb: bool = False):
    model = tiny_model(name).train()
    if perturb:  # a model that only matches after the checkpoint is loaded into it
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.5)
    gather_whole_decoder_layers(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=CONFIG)
    return engine


def train_engine(engine, inputs, layer_calls: list | None = None) -> list[float]:
    """Train on ``inputs``; ``layer_calls`` gets, per step, how often the first DecoderLayer ran
    (once: every parameter used by one forward, RAT+'s patterns stacked as row groups)."""
    losses = []
    first_layer = engine.module.model.layers[0]
    for ids in inputs:
        calls = []
        hook = first_layer.register_forward_hook(lambda *args: calls.append(1))
        loss = engine(input_ids=ids, labels=ids).loss
        hook.remove()
        if layer_calls is not None:
            layer_calls.append(len(calls))
        engine.backward(loss)
        engine.step()
        loss = loss.detach().clone()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    return losses


def check_model_type(name: str, out_dir: str) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    share = GLOBAL_BATCH // world_size
    global_batches = [random_ids(GLOBAL_BATCH, SEQ, seed=100 + step) for step in range(STEPS)]
    local_batches = [ids[rank * share : (rank + 1) * share] for ids in global_batches]

    reference = tiny_model(name).train()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LEARNING_RATE)
    reference_losses = []
    for ids in global_batches:
        loss = reference(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reference_losses.append(loss.item())

    engine = engine_for(name)
    layer_calls: list[int] = []
    sharded_losses = train_engine(engine, local_batches[:CHECKPOINT_AFTER], layer_calls)
    checkpoint = os.path.join(out_dir, f"zero3-{name}")
    engine.save_checkpoint(checkpoint, tag="mid")
    sharded_losses += train_engine(engine, local_batches[CHECKPOINT_AFTER:])

    resumed = engine_for(name, perturb=True)
    resumed.load_checkpoint(checkpoint, tag="mid")
    resumed_losses = train_engine(resumed, local_batches[CHECKPOINT_AFTER:])

    full_state = engine._zero3_consolidated_16bit_state_dict()  # collective; rank 0 gets the tensors
    result = {"reference_losses": reference_losses, "sharded_losses": sharded_losses, "resumed_losses": resumed_losses,
              "layer_calls_per_step": layer_calls}
    if rank == 0:
        result.update(gathered_weights_checks(full_state, reference, random_ids(2, SEQ, seed=7))[0])
    return result


def main() -> None:
    out_dir, names = sys.argv[1], sys.argv[2:] or list(MODEL_TYPES)
    hf_logging.disable_progress_bar()
    # DeepSpeed's CPU backend compiles a shared-memory all-reduce at start (minutes, a C++ build);
    # gloo does the collectives here, so it is not needed.
    # (sys.modules: the attribute deepspeed.comm.torch is PyTorch itself, imported by that package)
    import deepspeed.comm.torch  # noqa: F401

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    results = {name: check_model_type(name, out_dir) for name in names}
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "results.json"), "w") as file:
            json.dump(results, file, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
