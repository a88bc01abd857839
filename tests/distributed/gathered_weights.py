"""What the sharded-training workers (fsdp2_cpu_worker.py, zero3_cpu_worker.py) check of the weights
gathered after training: they load into a plain model bit for bit, and how far that model is from
the one-process reference (weights and logits)."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM


def gathered_weights_checks(full_state: dict, reference, ids: torch.Tensor) -> tuple[dict, torch.nn.Module]:
    """(results, the plain model holding ``full_state``)."""
    plain = AutoModelForCausalLM.from_config(reference.config)
    plain.load_state_dict(full_state)
    plain_state = plain.state_dict()
    results = {
        "loaded_bit_exact": all(torch.equal(plain_state[key], value) for key, value in full_state.items()),
        "max_param_diff_vs_reference": max(
            (value - reference.state_dict()[key]).abs().max().item() for key, value in full_state.items()
        ),
    }
    with torch.no_grad():
        results["final_logits_diff_vs_reference"] = (
            plain.eval()(input_ids=ids).logits - reference.eval()(input_ids=ids).logits
        ).abs().max().item()
    return results, plain
