"""Turn a padded batch into one packed row of tokens, and scatter packed outputs back.

    packed = pack(input_ids, attention_mask, position_ids=model_3d_position_ids)
    out = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
    logits = unpack(out.logits, packed)          # (batch, seq, vocab), zeros at padding

Packed position ids of vision-language families have four rows: the text row first (each
sequence counts 0, 1, 2, ...), then the model's own T/H/W mRoPE rows. The text row is
what marks sequence boundaries exactly (a sequence that begins with an image repeats its
temporal position 0). Patched models accept the 4-row layout on every release.

``packed(cu_seqlens)`` is a context manager that hands boundaries to patched models
directly, for callers that build their own layouts.

.. versionadded:: 0.1.0
"""

import contextlib
import dataclasses
import threading

import torch

__all__ = ["PackedBatch", "pack", "unpack", "packed", "current"]


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    input_ids: torch.Tensor       # (1, total)
    position_ids: torch.Tensor    # (1, total) text families; (4, 1, total) vision-language families
    cu_seqlens: torch.Tensor      # int32 (batch + 1,)
    max_seqlen: int
    indices: torch.Tensor         # positions of the kept tokens in the flattened (batch * seq) padded layout
    batch_size: int
    seq_len: int


def pack(input_ids, attention_mask, position_ids=None, *, vision=None):
    """Pack the tokens where ``attention_mask`` is 1.

    Args:
        input_ids: (batch, seq). attention_mask: (batch, seq), 1 for real tokens (left or right padding).
        position_ids: the model's own ids for the padded batch: (3, batch, seq) mRoPE ids from
            ``get_rope_index`` / :func:`tfcompat.embeds.rope_index`, or (batch, seq); None for text-only
            batches (then every row counts 0, 1, 2, ... per sequence).
        vision: force the 4-row layout (True) or the 1-row text layout (False); default: 4 rows when
            ``position_ids`` is 3-row.
    """
    mask = attention_mask.bool()
    batch, seq = mask.shape
    indices = torch.nonzero(mask.flatten()).flatten()
    lengths = mask.sum(dim=1)
    cu = torch.zeros(batch + 1, dtype=torch.int32, device=input_ids.device)
    cu[1:] = torch.cumsum(lengths, 0).to(torch.int32)
    text = torch.cat([torch.arange(int(n), device=input_ids.device) for n in lengths])
    ids = input_ids.flatten()[indices].unsqueeze(0)
    four = vision if vision is not None else (position_ids is not None and position_ids.dim() == 3)
    if position_ids is not None and position_ids.dim() == 3:
        rows = position_ids.flatten(1)[:, indices].unsqueeze(1)
    else:
        rows = text.view(1, 1, -1).expand(3, 1, -1)
    pos = torch.cat((text.view(1, 1, -1), rows.to(text.dtype)), dim=0) if four else text.unsqueeze(0)
    return PackedBatch(ids, pos, cu, int(lengths.max()), indices, batch, seq)


def unpack(x, packed):
    """(1, total, ...) -> (batch, seq, ...), zeros at padding."""
    tail = x.shape[2:]
    out = x.new_zeros((packed.batch_size * packed.seq_len, *tail))
    out = out.index_copy(0, packed.indices, x[0])
    return out.view(packed.batch_size, packed.seq_len, *tail)


_state = threading.local()


def current():
    """The innermost active ``(cu_seqlens, max_seqlen)``, or None."""
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def packed(cu_seqlens, max_seqlen=None):
    """Within the block, patched attention uses these boundaries (int32 (num_seqs + 1,))."""
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    stack.append((cu_seqlens, int(max_seqlen)))
    try:
        yield
    finally:
        stack.pop()
