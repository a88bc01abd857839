"""The training recipe the reproductions share: the papers' AdamW with warmup + cosine, shortened."""
from __future__ import annotations

import math

import torch


def adamw_warmup_cosine(model: torch.nn.Module, lr: float, steps: int):
    """AdamW (0.9, 0.95), weight decay 0.1; linear warmup over the first 5% of ``steps``, then
    cosine decay to 10% of ``lr``. Returns (optimizer, scheduler)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)

    def scale(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, scale)


def autocast_for(device: torch.device):
    """bf16 autocast on CUDA, a no-op context elsewhere (CPU presets compute in fp32)."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
