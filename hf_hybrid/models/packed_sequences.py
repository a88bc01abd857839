"""Packed (padding-free) rows: several documents concatenated in one row, each computed alone.

transformers' ``DataCollatorWithFlattening`` and TRL's padding-free packing put many documents in
one row and mark where each begins: ``position_ids`` that restart inside the row, and optionally
``cu_seq_lens_q`` / ``cu_seq_lens_k`` (cumulative lengths over the flattened batch, FlashAttention's
varlen form) or ``seq_idx`` (the document index of every token, Mamba's form). A document must then
compute exactly what it computes as a row of its own: no attention to, and no recurrent state from,
the documents before it.

Every token mixer of this package is causal, so a document followed by padding computes, on its real
tokens, exactly what it computes alone. The model therefore lays the documents of packed rows out as
a batch of whole documents, right-padded to a common length (:meth:`PackedDocuments.unpack`), runs
the decoder stack on that batch as on any unpadded batch (chunks, windows, forget-gate sums,
recurrent and SSM states all start at each document's first token), and gathers the outputs back
into the packed layout (:meth:`PackedDocuments.repack`) before the LM head, so labels and the loss
keep the collator's layout. Both moves are index gathers, so gradients flow through them exactly.

Documents of very different lengths are split into a few groups of similar length (each group one
pass of the stack), so padding never costs more than ``MAX_PADDING_RATIO`` times the real tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# A group of documents is padded to its longest one; a new group starts where padding the next
# document to that length would make the group's tokens exceed this many times its real tokens.
MAX_PADDING_RATIO = 1.5

# The keyword arguments through which collators mark document boundaries (besides position_ids).
PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


@dataclass
class DocumentGroup:
    """Documents of similar length laid out as a right-padded [num_docs, length] batch."""

    gather_index: torch.Tensor  # [num_docs * length] index into the flat tokens (pads: the zero row)
    positions: torch.Tensor  # [num_docs, length] long: each token's position (pads continue their document)
    num_docs: int
    length: int
    rows: tuple[int, ...] = ()  # the packed row each document comes from (per-row mixer keywords follow it)


@dataclass
class PackedDocuments:
    """Where each document of a packed batch lies, and the index maps between the packed layout
    [batch, seq] and the document batches of its groups."""

    groups: list[DocumentGroup]
    restore_index: torch.Tensor  # [batch * seq] index into the groups' outputs, flattened and concatenated
    batch_size: int
    seq_length: int
    document_lengths: list[int]

    def unpack(self, hidden_states: torch.Tensor, group: DocumentGroup) -> torch.Tensor:
        """[batch, seq, ...] in the packed layout -> [num_docs, length, ...] of ``group``'s documents."""
        flat = hidden_states.reshape(self.batch_size * self.seq_length, *hidden_states.shape[2:])
        flat = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])  # the padding row
        return flat.index_select(0, group.gather_index).reshape(group.num_docs, group.length, *flat.shape[1:])

    def repack(self, group_outputs: list[torch.Tensor]) -> torch.Tensor:
        """The groups' [num_docs, length, ...] outputs -> [batch, seq, ...] in the packed layout
        (columns that belong to no document, i.e. padding, get zeros)."""
        flat = torch.cat([g.reshape(g.shape[0] * g.shape[1], *g.shape[2:]) for g in group_outputs])
        flat = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])
        return flat.index_select(0, self.restore_index).reshape(self.batch_size, self.seq_length, *flat.shape[1:])


def _check_cu_seq_lens(cu_seq_lens: torch.Tensor, total: int, name: str) -> torch.Tensor:
    if cu_seq_lens.dim() != 1 or cu_seq_lens.numel() < 2:
        raise ValueError(f"{name} must be a 1-D tensor of cumulative document lengths [0, ..., total]; got shape {tuple(cu_seq_lens.shape)}.")
    cu_seq_lens = cu_seq_lens.to(torch.long)
    if int(cu_seq_lens[0]) != 0 or int(cu_seq_lens[-1]) != total or bool((cu_seq_lens.diff() < 0).any()):
        raise ValueError(
            f"{name} must rise from 0 to the number of tokens in the batch ({total}, batch x seq); got "
            f"{cu_seq_lens.tolist()[:8]}{'...' if cu_seq_lens.numel() > 8 else ''} ending at {int(cu_seq_lens[-1])}. "
            "Pass the cu_seq_lens the collator built for exactly these input_ids."
        )
    return cu_seq_lens


def document_starts(
    batch_size: int,
    seq_length: int,
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    cu_seq_lens: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, valid): [batch, seq] bool tensors. ``valid`` marks real tokens (attention_mask);
    ``starts`` marks each real token that begins a document: the first real token of a row, and every
    real token where ``position_ids`` do not continue the previous real token's by one, where
    ``seq_idx`` changes, or where ``cu_seq_lens`` starts a document."""
    device = next(t.device for t in (position_ids, seq_idx, cu_seq_lens, attention_mask) if t is not None)
    shape = (batch_size, seq_length)
    valid = torch.ones(shape, dtype=torch.bool, device=device) if attention_mask is None else attention_mask.to(device=device, dtype=torch.bool)
    boundary = torch.zeros(shape, dtype=torch.bool, device=device)  # a boundary between a token and the one before it
    if position_ids is not None:
        position_ids = position_ids.to(device).expand(shape)
    if cu_seq_lens is not None:
        cu_seq_lens = _check_cu_seq_lens(cu_seq_lens.to(device), batch_size * seq_length, "cu_seq_lens_q")
        flat = torch.zeros(batch_size * seq_length, dtype=torch.bool, device=device)
        flat[cu_seq_lens[:-1][cu_seq_lens.diff() > 0]] = True
        boundary |= flat.view(shape)
    if seq_idx is not None:
        if seq_idx.shape != shape:
            raise ValueError(f"seq_idx must be [batch, seq] = [{batch_size}, {seq_length}]; got {tuple(seq_idx.shape)}.")
        seq_idx = seq_idx.to(device)
    # Compare each real token with the previous real token of its row (padding is skipped over).
    column = torch.arange(seq_length, device=device).expand(shape)
    last_real = torch.where(valid, column, torch.full_like(column, -1)).cummax(dim=1).values
    previous = torch.cat([torch.full_like(last_real[:, :1], -1), last_real[:, :-1]], dim=1)  # previous real column or -1
    has_previous = previous >= 0
    gather_previous = previous.clamp(min=0)
    if position_ids is not None:
        boundary |= position_ids != position_ids.gather(1, gather_previous) + 1
    if seq_idx is not None:
        boundary |= seq_idx != seq_idx.gather(1, gather_previous)
    if cu_seq_lens is not None:
        # A boundary inside padding moves to the next real token.
        crossed = boundary.long().cumsum(1)
        boundary |= crossed != crossed.gather(1, gather_previous)
    starts = valid & (~has_previous | boundary)
    return starts, valid


def find_packed_documents(
    batch_size: int,
    seq_length: int,
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    cu_seq_lens: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
) -> PackedDocuments | None:
    """The documents of packed rows, or None when no row holds more than one document (an ordinary
    batch, padded or not: the model's usual path). One host synchronisation when position_ids,
    cu_seq_lens or seq_idx are given (the layout is planned on the host); none otherwise."""
    if seq_length < 2 or (position_ids is None and cu_seq_lens is None and seq_idx is None):
        return None
    if position_ids is not None and not (
        position_ids.dim() == 2 and position_ids.shape[1] == seq_length and position_ids.shape[0] in (1, batch_size)
    ):
        return None  # a malformed position_ids is reported by SequenceContext.build
    if attention_mask is not None and attention_mask.shape != (batch_size, seq_length):
        if cu_seq_lens is not None or seq_idx is not None:
            raise ValueError("cu_seq_lens_q / seq_idx (packed rows) cannot be combined with past_key_values or a cache.")
        return None  # a mask over cached tokens too: decoding with a cache, never packed
    starts, valid = document_starts(batch_size, seq_length, position_ids, attention_mask, cu_seq_lens, seq_idx)
    row_has_tokens = valid.any(dim=1)
    if int(starts.sum()) <= int(row_has_tokens.sum()):
        return None  # at most one document per row
    return _plan(starts, valid, position_ids)


def _plan(starts: torch.Tensor, valid: torch.Tensor, position_ids: torch.Tensor | None) -> PackedDocuments:
    batch_size, seq_length = starts.shape
    device = starts.device
    total = batch_size * seq_length
    flat_valid = valid.reshape(-1)
    doc_of_token = starts.reshape(-1).long().cumsum(0) - 1  # document index of each token (pads: their left neighbour's)
    start_index = starts.reshape(-1).nonzero().squeeze(1)
    lengths = torch.zeros(start_index.numel(), dtype=torch.long, device=device).index_add_(
        0, doc_of_token[flat_valid], torch.ones_like(doc_of_token[flat_valid])
    )
    # Documents are contiguous runs of real tokens only when no padding lies inside them.
    start_list, length_list = start_index.tolist(), lengths.tolist()
    flat_positions = None if position_ids is None else position_ids.to(device).expand(batch_size, seq_length).reshape(-1)

    groups: list[DocumentGroup] = []
    restore = torch.full((total,), 0, dtype=torch.long, device=device)
    offset = 0
    for members in _group_by_length(length_list):
        length = max(length_list[d] for d in members)
        doc_starts = torch.tensor([start_list[d] for d in members], device=device)
        doc_lengths = torch.tensor([length_list[d] for d in members], device=device)
        step = torch.arange(length, device=device)
        inside = step[None, :] < doc_lengths[:, None]
        token = doc_starts[:, None] + step[None, :]
        _check_contiguous(flat_valid, token, inside)
        gather = torch.where(inside, token, torch.full_like(token, total))
        if flat_positions is None:
            positions = step.expand(len(members), length)
        else:
            first = flat_positions[doc_starts]
            positions = first[:, None] + step[None, :]
            positions = torch.where(inside, flat_positions[token.clamp(max=total - 1)], positions)
        restore[token[inside]] = offset + (torch.arange(len(members), device=device)[:, None] * length + step[None, :])[inside]
        rows = tuple(start_list[d] // seq_length for d in members)
        groups.append(DocumentGroup(gather.reshape(-1), positions.contiguous(), len(members), length, rows))
        offset += len(members) * length
    restore[~flat_valid] = offset  # the zero row after every group's outputs
    return PackedDocuments(groups, restore, batch_size, seq_length, length_list)


def _check_contiguous(flat_valid: torch.Tensor, token: torch.Tensor, inside: torch.Tensor) -> None:
    if not bool(flat_valid[token[inside]].all()):
        raise ValueError(
            "attention_mask has padding inside a packed document (position_ids continue across masked "
            "tokens). Padding may only lie between documents or at the ends of a row."
        )


def _group_by_length(lengths: list[int]) -> list[list[int]]:
    """Documents (indices into ``lengths``) in groups of similar length, longest first: a group's
    padded size stays within MAX_PADDING_RATIO times its real tokens."""
    order = sorted(range(len(lengths)), key=lambda d: -lengths[d])
    groups: list[list[int]] = []
    for d in order:
        if groups:
            group = groups[-1]
            longest = lengths[group[0]]
            real = sum(lengths[m] for m in group) + lengths[d]
            if (len(group) + 1) * longest <= MAX_PADDING_RATIO * real:
                group.append(d)
                continue
        groups.append([d])
    return groups
