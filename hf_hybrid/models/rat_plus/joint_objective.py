"""RAT+'s joint training objective, sum_i w_i L_i over the training patterns, in the memory of one pass.

Every pattern but the one whose outputs the model returns runs its forward and at once its backward
(``torch.autograd.grad`` of w_i L_i with respect to what takes gradients: the trainable parameters
and the call's tensor inputs that require grad), which frees its graph; its gradients are kept,
summed over those patterns. The returned pattern then runs with its graph, and the loss handed back
is its weighted loss plus the others' values through :class:`_AddKeptGradients`, whose backward
gives every kept gradient, times the incoming gradient, to the tensor it belongs to. So whatever
scales the loss (gradient accumulation's 1/N, a GradScaler, ``accelerate.backward``) scales every
pattern as it scales a sum of graphs, and every gradient arrives through the one backward the
caller runs (where DDP's hooks see it: autograd sums a parameter's gradients before its
accumulator runs, once). A step holds one pass's activations and one buffer of gradients, and
costs the passes themselves.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class _AddKeptGradients(torch.autograd.Function):
    """``loss + others`` whose backward also hands ``kept[i] * grad_output`` to ``targets[i]``."""

    @staticmethod
    def forward(ctx, loss, others, kept, *targets):
        ctx.kept = kept
        return loss + others

    @staticmethod
    def backward(ctx, grad_output):
        kept, ctx.kept = ctx.kept, None
        if kept is None:
            raise RuntimeError(
                "RAT+'s joint objective loss was backpropagated twice: the other patterns' gradients are "
                "handed over once. Run one backward per forward (retain_graph is not supported here)."
            )
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in kept:
            if g is not None:
                by_device.setdefault(g.device, []).append(g)
        for device, grads in by_device.items():  # in place: the buffers are ours, and given away here
            torch._foreach_mul_(grads, grad_output.to(device))
        return (grad_output, None, None, *kept)


def _owned(grad: torch.Tensor, storages: set) -> torch.Tensor:
    """``grad`` as a buffer of its own, to add to and scale in place: autograd may hand out an
    expanded view (the gradient of a sum) or one tensor for several inputs (the gradient of a + b).
    ``storages`` holds the storages already kept."""
    if not grad.is_contiguous() or grad.untyped_storage().data_ptr() in storages:
        grad = grad.clone(memory_format=torch.contiguous_format)
    storages.add(grad.untyped_storage().data_ptr())
    return grad


def joint_loss(
    run_pattern: Callable[[object, dict], object],
    patterns: Sequence,
    weights: Sequence[float],
    inputs: dict,
    parameters: list[torch.Tensor],
):
    """Run the joint objective; returns (the outputs of ``patterns[0]``, the weighted total loss
    whose backward fills every gradient, the unweighted loss of each pattern, detached).

    ``run_pattern(pattern, inputs)`` runs one full forward with targets and returns an output with
    ``.loss``; ``parameters`` are the trainable parameters. Tensor inputs that require grad (e.g.
    ``inputs_embeds``) get their gradient too: the earlier passes see them detached, so a gradient
    that flows on past them (into what computed them) is added once, by the caller's backward."""
    grad_inputs = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.requires_grad}
    cut_inputs = dict(inputs, **{k: v.detach().requires_grad_() for k, v in grad_inputs.items()})
    sources = [cut_inputs[k] for k in grad_inputs]
    targets = parameters + [inputs[k] for k in grad_inputs]
    kept: list[torch.Tensor | None] = [None] * len(targets)
    losses: list[torch.Tensor | None] = [None] * len(patterns)
    storages: set[int] = set()
    for i in range(1, len(patterns)):
        out = run_pattern(patterns[i], cut_inputs)
        # The caller's backward runs outside autocast; so does this one.
        with torch.autocast(out.loss.device.type, enabled=False):
            grads = torch.autograd.grad(weights[i] * out.loss, parameters + sources, allow_unused=True)
        for j, g in enumerate(grads):
            if g is not None:
                kept[j] = _owned(g, storages) if kept[j] is None else kept[j].add_(g)
        losses[i] = out.loss.detach()
        del out, grads  # the graph went with the backward; the outputs go here
    first = run_pattern(patterns[0], inputs)
    losses[0] = first.loss.detach()
    others = sum(w * loss for w, loss in zip(weights[1:], losses[1:]))
    total = _AddKeptGradients.apply(weights[0] * first.loss, others, kept, *targets)
    return first, total, torch.stack(losses)


__all__ = ["joint_loss"]
