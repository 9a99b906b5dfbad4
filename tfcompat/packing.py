"""Turn a padded batch into one packed row of tokens, and scatter packed outputs back.

    >>> import torch
    >>> from tfcompat.packing import pack, unpack
    >>> ids = torch.tensor([[5, 6, 7], [8, 9, 0]])
    >>> mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    >>> packed = pack(ids, mask)
    >>> packed.input_ids, packed.position_ids, packed.cu_seqlens.tolist()
    (tensor([[5, 6, 7, 8, 9]]), tensor([[0, 1, 2, 0, 1]]), [0, 3, 5])
    >>> unpack(packed.input_ids[..., None].float(), packed)[..., 0]   # back to (batch, seq), zeros at padding
    tensor([[5., 6., 7.],
            [8., 9., 0.]])

With a patched model: ``model(input_ids=packed.input_ids, position_ids=packed.position_ids)``, then
``unpack(out.logits, packed)``; vision-language families pass their 3-row mRoPE ids to ``pack``.

Packed position ids of vision-language families have four rows: the text row first (each
sequence counts 0, 1, 2, ...), then the model's own T/H/W mRoPE rows. The text row is
what marks sequence boundaries exactly (a sequence that begins with an image repeats its
temporal position 0). Patched models accept the 4-row layout on every release.

``packed(cu_seqlens)`` is a context manager that hands boundaries to patched models
directly, for callers that build their own layouts.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Optional

import torch

from ._step import scope as _scope
from .errors import PackingError

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


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: Optional[torch.Tensor] = None, *,
         vision: Optional[bool] = None, config: Any = None) -> PackedBatch:
    """Pack the tokens where ``attention_mask`` is 1.

    Args:
        input_ids: (batch, seq). attention_mask: (batch, seq), 1 for real tokens (left or right padding).
        position_ids: the model's own ids for the padded batch: (3, batch, seq) mRoPE ids from
            ``get_rope_index`` / :func:`tfcompat.embeds.rope_index`, or (batch, seq); None for text-only
            batches (then every row counts 0, 1, 2, ... per sequence).
        vision: force the 4-row layout (True) or the 1-row text layout (False); default: 4 rows when
            ``position_ids`` is 3-row.
        config: the model's config; for a vision-language family, a batch that holds image or video
            tokens then requires the 3-D mRoPE positions (text positions would be wrong for them).

    .. versionchanged:: 0.1.0 validates its inputs; ``config=``.
    """
    mask = _check_pack(input_ids, attention_mask, position_ids, vision)
    if config is not None:
        _check_vision_positions(config, input_ids, mask, position_ids)
    batch, seq = mask.shape
    indices = torch.nonzero(mask.flatten()).flatten()
    lengths = mask.sum(dim=1)
    cu = torch.zeros(batch + 1, dtype=torch.int32, device=input_ids.device)
    cu[1:] = torch.cumsum(lengths, 0).to(torch.int32)
    text = torch.cat([torch.arange(int(n), device=input_ids.device) for n in lengths])
    ids = input_ids.flatten()[indices].unsqueeze(0)
    if position_ids is not None and position_ids.dim() == 2:
        given = position_ids.flatten()[indices]
        if not torch.equal(given.to(text.dtype), text):
            raise PackingError(
                "pack: the given 2-D position_ids do not count 0, 1, 2, ... over each row's real tokens, so the "
                "packed row could not mark where sequences begin; pass position_ids=None (pack counts them) or the "
                "model's 3-row mRoPE ids")
    four = vision if vision is not None else (position_ids is not None and position_ids.dim() == 3)
    if position_ids is not None and position_ids.dim() == 3:
        rows = position_ids.flatten(1)[:, indices].unsqueeze(1)
    else:
        rows = text.view(1, 1, -1).expand(3, 1, -1)
    pos = torch.cat((text.view(1, 1, -1), rows.to(text.dtype)), dim=0) if four else text.unsqueeze(0)
    return PackedBatch(ids, pos, cu, int(lengths.max()), indices, batch, seq)


def _check_vision_positions(config, input_ids, mask, position_ids):
    from ._probe.families import family
    from ._step.tokens import mm_token_type_ids

    if not family(config).vision:
        return
    vision_tokens = (mm_token_type_ids(config, input_ids) != 0) & mask
    if not bool(vision_tokens.any()):
        return
    if position_ids is None or position_ids.dim() != 3:
        raise PackingError(f"pack: the batch holds {int(vision_tokens.sum())} image/video tokens, which need the 3-D "
                           f"mRoPE positions; pass position_ids from tfcompat.embeds.rope_index(config, input_ids, "
                           f"image_grid_thw=..., attention_mask=...)")
    t, h, w = (position_ids[i][vision_tokens] for i in range(3))
    if bool(((t == h) & (h == w)).all()):
        raise PackingError("pack: the 3-row position_ids give every image/video token equal T, H and W positions "
                           "(text positions); pass the ids tfcompat.embeds.rope_index computed for these grids")


def _check_pack(input_ids, attention_mask, position_ids, vision):
    for name, t in (("input_ids", input_ids), ("attention_mask", attention_mask)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype.is_floating_point:
            raise PackingError(f"pack: {name} must be an integer (batch, seq) tensor, got "
                               f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
                               f"{' of ' + str(t.dtype) if isinstance(t, torch.Tensor) else ''}")
    if input_ids.shape != attention_mask.shape:
        raise PackingError(f"pack: input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
                           f"must have the same shape")
    if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
        raise PackingError("pack: attention_mask must hold only 0 and 1 (1 for real tokens)")
    if input_ids.shape[0] == 0:
        raise PackingError(f"pack: an empty batch (input_ids of shape {tuple(input_ids.shape)}); there is nothing to "
                           f"pack; skip the step, or pack at least one row with a real token")
    mask = attention_mask.bool()
    lengths = mask.sum(dim=1)
    if bool((lengths == 0).any()):
        row = int(torch.nonzero(lengths == 0)[0])
        raise PackingError(f"pack: row {row} of attention_mask has no real token; drop empty rows before packing")
    runs = (mask[:, 1:] & ~mask[:, :-1]).sum(dim=1) + mask[:, 0].long()
    if bool((runs > 1).any()):
        row = int(torch.nonzero(runs > 1)[0])
        raise PackingError(f"pack: row {row} of attention_mask has a hole (padding between real tokens); only left or "
                           f"right padding can be packed")
    if position_ids is not None:
        b, s = input_ids.shape
        ok = (position_ids.dim() == 2 and tuple(position_ids.shape) == (b, s)) or \
             (position_ids.dim() == 3 and tuple(position_ids.shape) == (3, b, s))
        if not isinstance(position_ids, torch.Tensor) or position_ids.dtype.is_floating_point or not ok:
            raise PackingError(f"pack: position_ids must be integer (batch, seq) = {(b, s)} or (3, batch, seq) = "
                               f"{(3, b, s)} (the model's get_rope_index output), got "
                               f"{tuple(position_ids.shape)} of {position_ids.dtype}")
        if vision is False and position_ids.dim() == 3:
            raise PackingError("pack: vision=False but 3-row mRoPE position_ids were given; they need the 4-row "
                               "layout (vision=True or None)")
    return mask


def unpack(x: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """(1, total, ...) -> (batch, seq, ...), zeros at padding."""
    total = packed.indices.numel()
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[0] != 1 or x.shape[1] != total:
        raise PackingError(f"unpack: expected the packed output (1, {total}, ...), got "
                           f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}; pass the output "
                           f"of the packed row this PackedBatch describes")
    tail = x.shape[2:]
    out = x.new_zeros((packed.batch_size * packed.seq_len, *tail))
    out = out.index_copy(0, packed.indices, x[0])
    return out.view(packed.batch_size, packed.seq_len, *tail)


def current() -> Any:
    """The innermost active ``(cu_seqlens, max_seqlen)``, or None."""
    entry = _scope.innermost(_scope.Packed)
    return None if entry is None else (entry.cu, entry.max_len)


@contextlib.contextmanager
def packed(cu_seqlens: torch.Tensor, max_seqlen: Optional[int] = None) -> Iterator[Any]:
    """Within the block, patched attention uses these boundaries (int32 (num_seqs + 1,))."""
    from ._attention.cu import check_cu_seqlens, check_longest

    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise PackingError(f"packed: cu_seqlens must be a 1-D tensor (0, ..., total), got {cu_seqlens!r}")
    bounds = check_cu_seqlens(cu_seqlens, int(cu_seqlens[-1]), "packed: cu_seqlens")
    max_seqlen = check_longest(bounds, max_seqlen, "packed")
    entry = _scope.Packed(cu_seqlens, int(max_seqlen))
    with _scope.carry(entry):
        yield
    if not entry.read:
        # fail closed: the block ran, and no model patched by this copy took the boundaries. A model patched by
        # another copy of tfcompat (a framework's vendored one beside the installed one) never reads this copy's
        # block, and an unpatched model knows none: either ran the row as one sequence
        package = __name__.rpartition(".")[0]
        raise PackingError(
            f"packed: no model patched by this copy of tfcompat ({package}) read these boundaries "
            f"{bounds} inside the block, so whatever ran in it treated the row as one sequence: a model patched "
            f"by another copy of tfcompat (a framework's vendored copy beside the installed package) reads only "
            f"its own copy's packed(), and an unpatched model reads none; patch the model with {package}.patch, "
            f"use that copy's packing.packed, or pass cu_seq_lens_q/k and max_length_q/k to the call")
