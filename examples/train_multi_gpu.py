"""Train any hf-hybrid architecture with transformers.Trainer on one GPU or sharded over several
(FSDP2 or DeepSpeed ZeRO-3 through accelerate), on generated copy-task data (nothing downloaded).

    python examples/train_multi_gpu.py --model-type rat --batch-size 8 --output-dir out/single
    accelerate launch --config_file examples/accelerate/fsdp2.yaml examples/train_multi_gpu.py \\
        --model-type rat --batch-size 4 --output-dir out/fsdp2
    accelerate launch --config_file examples/accelerate/zero3.yaml examples/train_multi_gpu.py \\
        --model-type rat --batch-size 4 --output-dir out/zero3
    ... --resume-from-checkpoint out/fsdp2/{model_type}/checkpoint-10    # continue runs mid-way

--batch-size is per process: 1 GPU x 8 and 2 GPUs x 4 train on the same global batches (the data is
read in order). --model-type takes a comma-separated list to train several architectures one after
the other in one launch. Per architecture, OUTPUT_DIR/MODEL_TYPE/ receives losses.json (the loss of
every optimizer step), Trainer checkpoints every --save-steps (sharded under FSDP2 / ZeRO-3) and
final/, the trained model as a normal save_pretrained checkpoint that loads on one device or CPU.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from torch.utils.data import Dataset, SequentialSampler
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

import hf_hybrid  # noqa: F401  (registers the architectures)
from hf_hybrid.cli import parse_overrides


class CopyTaskData(Dataset):
    """Row i: a random first half, then the same tokens again (the second half is predictable by
    looking back: any mixer that reaches far enough learns it). Drawn from seed + i, so every
    process and every run builds identical rows."""

    def __init__(self, rows: int, seq_len: int, vocab_size: int, seed: int):
        self.rows, self.seq_len, self.vocab_size, self.seed = rows, seq_len, vocab_size, seed

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: int) -> dict:
        half = torch.randint(3, self.vocab_size, (self.seq_len // 2,), generator=torch.Generator().manual_seed(self.seed + index))
        ids = torch.cat([half, half, half[: self.seq_len % 2]])
        return {"input_ids": ids, "labels": ids.clone()}


class HybridTrainer(Trainer):
    """Trainer that reads the data in order (every run, whatever its number of processes, trains on
    the same global batches: accelerate hands consecutive batches to consecutive ranks)."""

    def _get_train_sampler(self, train_dataset=None):
        return SequentialSampler(self.train_dataset if train_dataset is None else train_dataset)


def overrides_for(settings: list[str], model_type: str) -> dict:
    """--set KEY=VALUE applies to every model type, --set MODEL_TYPE:KEY=VALUE to that one only."""
    chosen = []
    for item in settings:
        target, colon, setting = item.partition(":")
        if colon and "=" not in target:
            if target == model_type:
                chosen.append(setting)
        else:
            chosen.append(item)
    return parse_overrides(chosen)


def build_config(args, model_type: str):
    return AutoConfig.for_model(
        model_type, vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, intermediate_size=2 * args.hidden_size, pad_token_id=0,
        max_position_embeddings=max(4096, args.seq_len), **overrides_for(args.set, model_type),
    )


def uses_deepspeed() -> bool:
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def train_one(args, model_type: str) -> dict:
    output_dir = os.path.join(args.output_dir, model_type)
    config = build_config(args, model_type)
    torch.manual_seed(args.seed)  # the same initial weights in every process and every run
    model = AutoModelForCausalLM.from_config(config)
    if args.bf16_weights:
        model = model.to(torch.bfloat16)
    if uses_deepspeed():
        from hf_hybrid.distributed import gather_whole_decoder_layers

        gather_whole_decoder_layers(model)  # ZeRO-3 gathers a whole DecoderLayer at a time
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    data = CopyTaskData(args.max_steps * args.batch_size * world_size, args.seq_len, args.vocab_size, args.seed)
    training_args = TrainingArguments(
        output_dir=output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.learning_rate, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
        logging_steps=1, save_strategy="steps", save_steps=args.save_steps, save_only_model=False,
        bf16=args.bf16 and not args.bf16_weights, report_to=[], seed=args.seed, disable_tqdm=True, dataloader_drop_last=True,
    )
    if training_args.world_size != world_size:
        raise RuntimeError(
            f"{world_size} processes were launched but the Trainer trains on {training_args.world_size}: "
            "each process would train alone. accelerate distributes the Trainer over GPUs; on CPU, see "
            "tests/distributed/ for FSDP2 and ZeRO-3 on gloo processes."
        )
    trainer = HybridTrainer(model=model, args=training_args, train_dataset=data)
    resume = args.resume_from_checkpoint.format(model_type=model_type) if args.resume_from_checkpoint else None
    trainer.train(resume_from_checkpoint=resume)
    losses = {int(entry["step"]): entry["loss"] for entry in trainer.state.log_history if "loss" in entry}

    # The whole model, gathered from the shards (collective: every process calls it), saved as a
    # plain checkpoint by the main process.
    state_dict = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    final_dir = os.path.join(output_dir, "final")
    if trainer.is_world_process_zero():
        plain = type(trainer.accelerator.unwrap_model(trainer.model))(config)  # unsharded, float32, on CPU
        plain.load_state_dict({name: tensor.float().cpu() for name, tensor in state_dict.items()})
        plain.save_pretrained(final_dir)
        summary = {"model_type": model_type, "world_size": trainer.args.world_size, "losses": losses, "final": final_dir}
        with open(os.path.join(output_dir, "losses.json"), "w") as file:
            json.dump(summary, file, indent=1)
        return summary
    return {}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-type", default="rat", help="an hf-hybrid model type, or several separated by commas")
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=4, help="rows per process and step")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--save-steps", type=int, default=10)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (the accelerate configs set it too)")
    parser.add_argument("--bf16-weights", action="store_true",
                        help="bf16 weights without autocast (the forward ZeRO-3's bf16 mode computes; a reference run)")
    parser.add_argument("--resume-from-checkpoint", default=None,
                        help="a checkpoint-N folder of an earlier run; {model_type} in it names each model type's")
    parser.add_argument("--output-dir", default="multi_gpu_output")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config fields; MODEL_TYPE:KEY=VALUE for one model type only")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model_types = [name.strip() for name in args.model_type.split(",") if name.strip()]
    if args.resume_from_checkpoint and len(model_types) > 1 and "{model_type}" not in args.resume_from_checkpoint:
        raise ValueError("--resume-from-checkpoint with several model types: put {model_type} in the path.")
    return [train_one(args, model_type) for model_type in model_types]


if __name__ == "__main__":
    main()
