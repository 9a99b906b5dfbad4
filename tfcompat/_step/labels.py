"""The labels of a packed row: where its sequences start for the loss (eagerly, and under torch.compile by
:func:`traced_label_starts`), the targets across a boundary dropped, and labels a sequence-parallel share
cannot pair refused."""

from __future__ import annotations

from .._attention.boundaries import explicit_cu, mask_valid, text_row
from .._attention.starts import _assert, _traced_starts_of_positions, restarts
from ..errors import PackingError, UlyssesError
from .install import decoding


def packed_labels(state, kwargs):
    """``labels`` of a packed row: upstream's shift makes each sequence's last token predict the next sequence's
    first, a target the padded batch does not have. Those targets are dropped (-100, out of place), as
    DataCollatorWithFlattening does; with ``num_items_in_batch`` (the Trainer's count of targets, taken from
    the same labels) the count would include them too: refused. One host sync per step with labels."""
    import torch

    labels = kwargs.get("labels")
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2 or labels.shape[0] != 1 or state.split():
        return
    if torch.compiler.is_compiling():  # traced: the same rule by tensor ops, the refusal a device-side assertion
        at = traced_label_starts(kwargs, labels.shape[1])
        if at is None:
            return
        at = at.to(labels.device)
        if kwargs.get("num_items_in_batch") is not None:
            _assert(~(at & (labels != -100)).any(), (
                f"{state.family}: packed labels hold targets at sequence starts that num_items_in_batch counted; "
                f"set them to -100 before counting (DataCollatorWithFlattening does)"))
        kwargs["labels"] = labels.masked_fill(at, -100)
        return
    starts = label_starts(kwargs, labels.shape[1])
    if not starts:
        return
    index = torch.tensor(starts, dtype=torch.long, device=labels.device)
    crossing = labels.index_select(1, index) != -100
    if not bool(crossing.any()):
        return
    if kwargs.get("num_items_in_batch") is not None:
        raise PackingError(
            f"tfcompat {state.family}: labels of a packed row hold targets at sequence starts "
            f"{[s for s, c in zip(starts, crossing[0].tolist()) if c]}: upstream's shift would make each "
            f"sequence's last token predict the next sequence's first, and num_items_in_batch counted those "
            f"targets; set labels to -100 at every sequence start before counting (DataCollatorWithFlattening "
            f"does), or pass no num_items_in_batch (tfcompat then drops those targets)")
    kwargs["labels"] = labels.index_fill(1, index, -100)


def refuse_whole_row_labels(state, kwargs):
    """Labels under a sequence-parallel split. A share (every rank its part of a packed row): upstream's loss
    shifts them inside the share, so the target of the share's last token (the next share's first label) is lost
    and the mean runs over the share: refused unless the caller passes ``shift_labels`` (targets shifted over the
    whole row, then sliced). A decoding call (generate: each rank its own prompts) is not a share."""
    if kwargs.get("labels") is None or not state.split():
        return
    if not state.slice_inputs:
        if kwargs.get("shift_labels") is None and not decoding(kwargs):
            raise UlyssesError(
                f"tfcompat {state.family}: labels of a sequence-parallel share: upstream's loss shifts them inside "
                f"this rank's share, so the share's last token loses its target (the next share's first label) and "
                f"the loss is this share's mean, not the row's. Pass shift_labels as well: the whole row's labels "
                f"shifted (labels[..., 1:], then -100) and sliced like the inputs (tfcompat.ulysses.slice_for_rank), "
                f"with num_items_in_batch the row's count of targets, so the ranks' losses sum to the row's; or "
                f"call without labels and compute the loss from the logits; or train with "
                f"tfcompat.trainer.SequenceParallelMixin, which does this for transformers.Trainer and TRL")
        return
    raise UlyssesError(
        f"tfcompat {state.family}: labels with slice_inputs=True: the model returns this rank's slice of the "
        f"logits, which upstream's loss cannot pair with the whole row's labels; call without labels and "
        f"compute the loss on the gathered logits (tfcompat.ulysses.gather_from_ranks), or on this rank's "
        f"slice of the shifted labels (tfcompat.ulysses.slice_for_rank)")


def label_starts(kwargs, n):
    """Sequence starts after the first (Python ints) of a packed row of ``n`` tokens, as the top-level call names
    them (the flattening collator's boundaries, tfcompat.packing.packed, seq_idx, or the text row of the positions); []
    for a row that is not packed or whose boundaries the text model will refuse. Under torch.compile:
    :func:`traced_label_starts`."""
    import torch

    cu = explicit_cu(kwargs)
    if isinstance(cu, torch.Tensor) and cu.dim() == 1 and cu.numel() >= 2:
        return [int(x) for x in cu.tolist()[1:-1] if 0 < int(x) < n]
    seq_idx = kwargs.get("seq_idx")
    if isinstance(seq_idx, torch.Tensor) and seq_idx.dim() == 2 and tuple(seq_idx.shape) == (1, n):
        return (torch.nonzero(seq_idx[0, 1:] != seq_idx[0, :-1]).flatten() + 1).tolist()
    text = text_row(kwargs.get("position_ids"))
    if text is None or text.shape != (1, n) or mask_valid(kwargs.get("attention_mask"), n) is not None:
        return []
    starts, down = restarts(text[0])  # the one reading of starts from positions (traced: traced_label_starts)
    return [] if down is not None else starts[1:]


def traced_label_starts(kwargs, n):
    """Bool (1, n) of the sequence starts after the first of a traced packed row (what :func:`label_starts`
    lists eagerly), or None where the call names none."""
    import torch

    cu = explicit_cu(kwargs)
    if isinstance(cu, torch.Tensor) and cu.dim() == 1 and cu.numel() >= 2:
        idx = torch.arange(n, device=cu.device)
        return ((idx[:, None] == cu[1:-1].to(torch.int64)[None, :]).any(-1) & (idx > 0))[None]
    seq_idx = kwargs.get("seq_idx")
    if isinstance(seq_idx, torch.Tensor) and seq_idx.dim() == 2 and tuple(seq_idx.shape) == (1, n):
        return torch.cat((torch.zeros((1, 1), dtype=torch.bool, device=seq_idx.device),
                          seq_idx[:, 1:] != seq_idx[:, :-1]), dim=1)
    text = text_row(kwargs.get("position_ids"))
    if text is None or tuple(text.shape) != (1, n) or kwargs.get("attention_mask") is not None:
        return None
    return _traced_starts_of_positions(text[0])[None] & (torch.arange(n, device=text.device) > 0)[None]
