"""One rank of the CPU context-parallelism check (tests/distributed/test_context_parallel_cpu.py):

    torchrun --standalone --nproc-per-node N tests/distributed/context_parallel_cpu_worker.py OUT_DIR [MODEL ...]
        [--device cuda --dtype bfloat16 --seq 2048 --hidden 256] [--layouts contiguous,balanced]
        (GPUs: tests/gpu/context_parallel_gpu_check.py)

Per model (float32, reference kernels): one process runs the whole sequence (logits, loss and
every parameter's gradient), then the ranks run it split over the gloo group with
hf_hybrid.distributed.context_parallel (each rank its shard, labels pre-shifted, gradients summed
over the group), once per layout of --layouts (contiguous shards; balanced: rank r holds chunks r
and 2N - 1 - r; its results named "name:balanced"), the logits also gathered back (unshard). The largest differences over all ranks go to OUT_DIR/results-N.json, with the
largest share of a shard's tokens any all-gather along the sequence took, or SE's all-to-all of
retrieved blocks brought from one rank (what a rank holds of the others' keys). SE checks in SEGMENT_PATHS
run the segments' attention on a named path (reference in query blocks, fused, fused with the
Triton block kernels: set TRITON_INTERPRET=1 on CPU). Single layers (LAYERS) and FoX's ring alone on random inputs (RINGS) are checked
the same way.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "features"))
from tiny_models import random_ids, tiny_model  # noqa: E402

from hf_hybrid.distributed.context_parallel import ContextParallelGroup, context_parallel  # noqa: E402
from hf_hybrid.layers.context import SequenceContext  # noqa: E402

BATCH = 2
# Set by the command line: CPU float32 at the tiny size by default; GPUs run wider heads (the
# Triton kernels take head_dim 16 .. 256) and longer rows in bf16.
SETTINGS = {"device": "cpu", "dtype": "float32", "seq": 32, "hidden": 0, "layouts": "contiguous,balanced"}


def seq_len(cp: ContextParallelGroup) -> int:
    """The rows' length: SETTINGS' seq, longer where the balanced layout's chunks (2 per rank) would
    be shorter than 8 tokens (the tiny models' sliding window of 6 reaches into one chunk before)."""
    return max(SETTINGS["seq"], 8 * cp.num_chunks)


def build(model_type: str, **overrides):
    checkpointed = overrides.pop("gradient_checkpointing", False)
    if SETTINGS["hidden"]:
        hidden = SETTINGS["hidden"]
        overrides = overrides | dict(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4)
    backend = {} if SETTINGS["device"] != "cpu" else {"kernel_backend": "reference"}
    model = tiny_model(model_type, **(backend | overrides)).train()
    if checkpointed:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.to(SETTINGS["device"], getattr(torch, SETTINGS["dtype"]))
# name -> (tiny model type, overrides): whole models whose every mixer context parallelism covers.
MODELS = {
    "rat": ("rat", {}),
    "rat_nope": ("rat", {"use_rope": False}),
    "rat_swa": ("rat_swa", {}),
    "rat_full_attention": ("rat", {"layer_types": ["rat", "full_attention"]}),
    "rat_plus": ("rat_plus", {}),
    "rat_plus_sinks": ("rat_plus", {"training_dilations": [1, {"dilation": 4, "local_window": 2, "num_sink_tokens": 1}]}),
    "rat_plus_no_recurrence": ("rat_plus", {"use_recurrence": False}),
    # one dilated pattern alone (its logits compared): the shards exchange only chunk ends, halo and sinks
    "rat_plus_dilated": ("rat_plus", {"training_dilations": [{"dilation": 4, "local_window": 2, "num_sink_tokens": 2}]}),
    # heads of one layer on both exchanges: head 1 dense (the ring, its key head repeated), 0, 2, 3 dilated
    "rat_plus_mixed_heads": ("rat_plus", {"training_dilations": [{"dilation": 4, "num_sink_tokens": 1, "head_overrides": {1: "dense"}}]}),
    "fox_llama": ("fox_llama", {}),
    "fox_pro": ("fox_pro", {}),
    "fox_pro_rope": ("fox_pro", {"use_rope": True}),
    "rattention": ("rattention", {}),
    "rattention_linear": ("rattention", {"window_size": -1, "layer_types": ["local", "local"]}),
    "se_hybrid": ("se_hybrid", {}),
    "se_hybrid_full": ("se_hybrid", {"attention_mode": "full"}),
    "se_hybrid_swa": ("se_hybrid", {"attention_mode": "swa"}),
    # SE chunks longer than a rank's chunk: the local span's halo and the retrieval's query sums cross chunks
    "se_hybrid_long_chunks": ("se_hybrid", {"se_chunk_sizes": [16], "se_eval_chunk_size": 16}),
    "se_hybrid_nomem": ("se_hybrid", {"attention_mode": "se_nomem", "se_chunk_sizes": [24], "se_eval_chunk_size": 24}),
    "se_hybrid_longer_chunks": ("se_hybrid", {"se_chunk_sizes": [24], "se_eval_chunk_size": 24}),
    # activation checkpointing: the backward (inside the block) reruns each layer's exchange
    "fox_pro_checkpointed": ("fox_pro", {"gradient_checkpointing": True}),
    "se_hybrid_checkpointed": ("se_hybrid", {"gradient_checkpointing": True}),
    # the segments' attention on its two paths (se_segment.py): the reference in blocks of 3 queries
    # (blocks across selection groups of 4), and the one-process layer's fused path over a virtual
    # sequence (CPU's flash kernel here), its retrieved blocks moved by index_select or, under
    # Triton's CPU interpreter, by the Triton kernels CUDA runs (block_rows.py)
    "se_hybrid_query_blocks": ("se_hybrid", {}),
    "se_hybrid_fused": ("se_hybrid", {}),
    "se_hybrid_swa_fused": ("se_hybrid", {"attention_mode": "swa"}),
    "se_hybrid_nomem_fused": ("se_hybrid", {"attention_mode": "se_nomem", "se_chunk_sizes": [24], "se_eval_chunk_size": 24}),
    "se_hybrid_long_chunks_fused": ("se_hybrid", {"se_chunk_sizes": [16], "se_eval_chunk_size": 16}),
    "se_hybrid_triton": ("se_hybrid", {}),
    "se_hybrid_long_chunks_triton": ("se_hybrid", {"se_chunk_sizes": [16], "se_eval_chunk_size": 16}),
}
# name -> (the SE segments' attention backend, queries per block of the reference, whether retrieved
# blocks move by the Triton kernels) under context parallelism; the one-process run keeps the reference.
SEGMENT_PATHS = {
    "se_hybrid_query_blocks": ("reference", 3, False), "se_hybrid_fused": ("sdpa", None, False),
    "se_hybrid_swa_fused": ("sdpa", None, False), "se_hybrid_nomem_fused": ("sdpa", None, False),
    "se_hybrid_long_chunks_fused": ("sdpa", None, False), "se_hybrid_triton": ("sdpa", None, True),
    "se_hybrid_long_chunks_triton": ("sdpa", None, True),
}
# name -> (tiny model type, index of the layer checked alone): covered mixers of models that also
# hold uncovered ones (SE hybrids need an attention layer beside their Mamba-2 layers).
LAYERS = {"mamba2_layer": ("se_hybrid", 0)}
# name -> the ring's block backend: FoX's ring attention alone on random inputs (4 query heads
# over 2 key heads of 16), against the reference on the whole sequence. On CPU the Triton blocks
# run in Triton's interpreter: cheaper here than a whole layer of Triton kernels.
RINGS = {"fox_ring_triton": "triton"}


@contextlib.contextmanager
def gathered_tokens(shard_len: int, rows_per_token: int = 1):
    """Records, for every all-gather along the sequence (dim 1) in the block, the share of a
    shard's tokens each rank contributed (sums and states, gathered along dim 0, count 0): what a
    rank ends up holding of the other shards' keys and values, as a fraction of a shard each.
    SE's all-to-all of retrieved blocks counts the (batch row, key head) blocks a rank receives
    from another rank, as a share of that rank's shard (``rows_per_token``: batch x key heads)."""
    shares = []
    original, original_exchange = ContextParallelGroup.all_gather, ContextParallelGroup.exchange_rows

    def recording(self, tensor, dim):
        shares.append(tensor.shape[dim] / shard_len if dim == 1 else 0.0)
        return original(self, tensor, dim)

    def recording_exchange(self, rows, send_counts, recv_counts):
        # rows [(batch row, key head, block) units, block tokens, 2 x head_dim], counted from the other ranks
        others = [count for rank, count in enumerate(recv_counts) if rank != self.rank]
        shares.append(max(others, default=0) * rows.shape[1] / (shard_len * rows_per_token))
        return original_exchange(self, rows, send_counts, recv_counts)

    ContextParallelGroup.all_gather, ContextParallelGroup.exchange_rows = recording, recording_exchange
    try:
        yield shares
    finally:
        ContextParallelGroup.all_gather, ContextParallelGroup.exchange_rows = original, original_exchange


@contextlib.contextmanager
def segment_path(name: str):
    """For SEGMENT_PATHS' checks, the SE segments' attention on the named path (the one-process run
    on the whole sequence keeps the reference)."""
    if name not in SEGMENT_PATHS:
        yield
        return
    from hf_hybrid.distributed.context_parallel import se_hybrid
    from hf_hybrid.kernels import _query_blocks
    from hf_hybrid.kernels.span_expanded_attention import chunked

    backend, block, block_kernels = SEGMENT_PATHS[name]
    if block_kernels and SETTINGS["device"] == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"{name}: set TRITON_INTERPRET=1 to run the Triton kernels on CPU.")
    saved = se_hybrid.segment_backend, _query_blocks.query_block_size, chunked._use_block_kernels
    se_hybrid.segment_backend = lambda kernel_backend, device: backend
    if block is not None:
        _query_blocks.query_block_size = lambda num_queries, *rest: min(block, num_queries)
    chunked._use_block_kernels = lambda device: block_kernels
    try:
        yield
    finally:
        se_hybrid.segment_backend, _query_blocks.query_block_size, chunked._use_block_kernels = saved


def check(name: str, cp: ContextParallelGroup) -> dict:
    model_type, overrides = MODELS[name]
    model = build(model_type, **dict(overrides))
    ids = random_ids(BATCH, seq_len(cp), seed=11).to(SETTINGS["device"])
    labels = ids.clone()
    labels[0, 5] = -100  # an ignored target: the counts must come from the whole sequence

    full = model(input_ids=ids, labels=labels, skip_logits=False)
    full.loss.backward()
    reference_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    targets = cp.shard_labels(labels)
    with context_parallel(model, cp), segment_path(name), gathered_tokens(seq_len(cp) // cp.world_size, BATCH * getattr(model.config, "num_key_value_heads", 1)) as gathered:
        out = model(input_ids=cp.shard(ids), shift_labels=targets, num_items_in_batch=cp.count_targets(targets), use_cache=False, skip_logits=False)
        out.loss.backward()  # inside the block: a checkpointed layer's recompute exchanges too
    cp.all_reduce_gradients(model)
    with torch.no_grad():  # control: the shard alone, no exchange (must differ beyond the first rank)
        alone = model(input_ids=cp.shard(ids), use_cache=False).logits
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=cp.group)

    diffs = torch.tensor(device=SETTINGS["device"], data=[
        (loss - full.loss.detach()).abs().item(),
        (out.logits.detach() - cp.shard(full.logits.detach())).abs().max().item(),
        max((p.grad - reference_grads[n]).abs().max().item() for n, p in model.named_parameters() if n in reference_grads),
        max(g.abs().max().item() for g in reference_grads.values()),
        (alone - cp.shard(full.logits.detach())).abs().max().item(),
        (cp.unshard(out.logits.detach()) - full.logits.detach()).abs().max().item(),  # the layout's gather
        max(gathered, default=0.0),  # the largest over the ranks (SE's blocks come to some ranks only)
    ])
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX, group=cp.group)
    missing = [n for n, p in model.named_parameters() if (p.grad is None) != (n not in reference_grads)]
    late_backward_refused = None
    if model.is_gradient_checkpointing:  # a backward after the block must be refused, not run without the exchange
        with context_parallel(model, cp):
            late = model(input_ids=cp.shard(ids), shift_labels=targets, num_items_in_batch=cp.count_targets(targets), use_cache=False)
        try:
            late.loss.backward()
            late_backward_refused = False
        except RuntimeError as error:
            late_backward_refused = "inside the block" in str(error)
        model.zero_grad()
        model(input_ids=cp.shard(ids), use_cache=False)  # a plain forward after it puts the mixers back
    return {"loss_diff": diffs[0].item(), "logits_diff": diffs[1].item(), "grad_diff": diffs[2].item(),
            "grad_scale": diffs[3].item(), "no_exchange_logits_diff": diffs[4].item(), "unshard_logits_diff": diffs[5].item(), "loss": full.loss.item(),
            "missing_grads": missing, "largest_gather": diffs[6].item(), "late_backward_refused": late_backward_refused}


def check_layer(name: str, cp: ContextParallelGroup) -> dict:
    """One DecoderLayer on random hidden states: its output, the input's gradient and every
    parameter's gradient, whole sequence vs split."""
    model_type, index = LAYERS[name]
    layer = build(model_type).model.layers[index]
    param = next(layer.parameters())
    hidden = torch.randn(BATCH, seq_len(cp), layer.mlp.gate_proj.in_features, generator=torch.Generator().manual_seed(3))
    weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(4))
    hidden, weights = hidden.to(param.device, param.dtype), weights.to(param.device, param.dtype)

    def run(x):
        context = SequenceContext.build(x.shape[0], x.shape[1], 0, None, None, x.device)
        return layer(x, context)

    full_input = hidden.clone().requires_grad_()
    full = run(full_input)
    (full * weights).sum().backward()
    reference_grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()

    shard_input = cp.shard(hidden).requires_grad_()
    with context_parallel(layer, cp):
        out = run(shard_input)
    (out * cp.shard(weights)).sum().backward()
    cp.all_reduce_gradients(layer)
    with torch.no_grad():  # control: the shard alone, no exchange (must differ beyond the first rank)
        alone = run(cp.shard(hidden))
    diffs = torch.tensor(device=SETTINGS["device"], data=[
        0.0,
        (out.detach() - cp.shard(full.detach())).abs().max().item(),
        max([(p.grad - reference_grads[n]).abs().max().item() for n, p in layer.named_parameters()]
            + [(shard_input.grad - cp.shard(full_input.grad)).abs().max().item()]),
        max(g.abs().max().item() for g in reference_grads.values()),
        (alone - cp.shard(full.detach())).abs().max().item(),
    ])
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX, group=cp.group)
    missing = [n for n, p in layer.named_parameters() if p.grad is None]
    return {"loss_diff": diffs[0].item(), "logits_diff": diffs[1].item(), "grad_diff": diffs[2].item(),
            "grad_scale": diffs[3].item(), "no_exchange_logits_diff": diffs[4].item(), "missing_grads": missing}


def check_ring(name: str, cp: ContextParallelGroup) -> dict:
    """ring_forgetting_attention on each rank's shard (every gradient summed over the ranks) vs
    forgetting_attention_reference on the whole sequence: output, dq, dk, dv and d log f."""
    from torch.nn import functional as F

    from hf_hybrid.distributed.context_parallel.fox import ring_forgetting_attention
    from hf_hybrid.kernels.forgetting_attention import cumulative_log_forget, forgetting_attention_reference

    device, dtype = SETTINGS["device"], getattr(torch, SETTINGS["dtype"])
    g = torch.Generator().manual_seed(5)
    seq, heads, kv_heads, dim = seq_len(cp), 4, 2, 16
    shapes = [(BATCH, seq, heads, dim), (BATCH, seq, kv_heads, dim), (BATCH, seq, kv_heads, dim)]
    q, k, v = (torch.randn(shape, generator=g).to(device, dtype) for shape in shapes)
    log_f = F.logsigmoid(torch.randn(BATCH, seq, heads, generator=g) * 2 + 1.5).to(device)
    weights = torch.randn(BATCH, seq, heads, dim, generator=g).to(device, dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, log_f)]
    full = forgetting_attention_reference(*leaves)
    full_grads = torch.autograd.grad((full.float() * weights.float()).sum(), leaves)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, log_f)]
    c = cp.shard(cumulative_log_forget(leaves[3]))  # the whole sequence's c at this shard's tokens
    out = ring_forgetting_attention(*(cp.shard(t) for t in leaves[:3]), c, cp, dim**-0.5, RINGS[name])
    grads = [grad.contiguous() for grad in torch.autograd.grad((out.float() * cp.shard(weights).float()).sum(), leaves)]
    for grad in grads:  # NCCL reduces contiguous tensors only
        dist.all_reduce(grad, group=cp.group)
    alone = forgetting_attention_reference(*(cp.shard(t) for t in (q, k, v, log_f)))  # control: no exchange
    diffs = torch.tensor(device=device, data=[
        0.0,
        (out.float() - cp.shard(full.detach()).float()).abs().max().item(),
        max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, full_grads)),
        max(b.abs().max().item() for b in full_grads),
        (alone.float() - cp.shard(full.detach()).float()).abs().max().item(),
    ])
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX, group=cp.group)
    return {"loss_diff": diffs[0].item(), "logits_diff": diffs[1].item(), "grad_diff": diffs[2].item(),
            "grad_scale": diffs[3].item(), "no_exchange_logits_diff": diffs[4].item(), "missing_grads": []}


def main() -> None:
    args = sys.argv[1:]
    while "--" in " ".join(args):  # --name value pairs anywhere after OUT_DIR
        index = next(i for i, a in enumerate(args) if a.startswith("--"))
        key, value = args[index][2:], args[index + 1]
        SETTINGS[key] = type(SETTINGS[key])(value)
        del args[index : index + 2]
    out_dir, names = args[0], args[1:] or [*MODELS, *LAYERS, *RINGS]
    if SETTINGS["device"] == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        SETTINGS["device"] = f"cuda:{torch.cuda.current_device()}"
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
        torch.set_num_threads(1)
    checks = {**dict.fromkeys(MODELS, check), **dict.fromkeys(LAYERS, check_layer), **dict.fromkeys(RINGS, check_ring)}
    results = {}
    for layout in SETTINGS["layouts"].split(","):  # results of the balanced layout as "name:balanced"
        cp = ContextParallelGroup.from_group(layout=layout)
        suffix = "" if layout == "contiguous" else f":{layout}"
        results |= {name + suffix: checks[name](name, cp) for name in names}
    if cp.rank == 0:
        with open(os.path.join(out_dir, f"results-{cp.world_size}.json"), "w") as file:
            json.dump(results, file, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
