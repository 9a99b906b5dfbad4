"""Ulysses sequence parallelism over ``torch.distributed`` (gloo on CPU, NCCL on GPU).

Each rank of a group holds a contiguous slice of the sequence. Around attention,
an all-to-all turns "my tokens, all heads" into "all tokens, my heads", and back:

    (s_local, heads, d) --gather_seq_scatter_heads--> (s_local * P, heads / P, d)
    (s_local * P, heads / P, d) --gather_heads_scatter_seq--> (s_local, heads, d)

Both are autograd functions whose backward is the other all-to-all.
``slice_for_rank`` pads a tensor's sequence dim to a multiple of the group size and keeps
this rank's slice; ``gather_from_ranks`` concatenates the slices back (its backward keeps
this rank's slice of the gradient, so summing parameter gradients over the group gives
the single-process gradient).

.. versionadded:: 0.1.0
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from ._kernels.collectives import all_gather
from .errors import UlyssesError

__all__ = ["UlyssesError", "gather_seq_scatter_heads", "gather_heads_scatter_seq", "slice_for_rank",
           "gather_from_ranks", "repeat_kv_for_group", "padded_length", "slice_inputs"]


def _size(group):
    return dist.get_world_size(group)


def _a2a(x, group):
    x = x.contiguous()
    out = torch.empty_like(x)  # contiguous too: the collective writes in memory order
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x, group):
    p = _size(group)
    s, h, d = x.shape
    if h % p:
        raise UlyssesError(f"Ulysses: {h} heads do not divide over a group of {p} ranks; use a group size that "
                           f"divides the head count")
    x = x.reshape(s, p, h // p, d).transpose(0, 1)  # (p, s, h/p, d): chunk j goes to rank j
    return _a2a(x, group).reshape(p * s, h // p, d)


def _heads_to_seq(x, group):
    p = _size(group)
    total, hp, d = x.shape
    x = x.reshape(p, total // p, hp, d)  # chunk j: rank j's tokens, my heads
    out = _a2a(x, group)  # chunk j: my tokens, rank j's heads
    return out.transpose(0, 1).reshape(total // p, p * hp, d)


class _AllToAll(torch.autograd.Function):
    """Sequence <-> heads all-to-all; the backward runs the opposite direction."""

    @staticmethod
    def forward(ctx, x, group, to_heads):
        ctx.group, ctx.to_heads = group, to_heads
        return _seq_to_heads(x, group) if to_heads else _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        back = _heads_to_seq(grad, ctx.group) if ctx.to_heads else _seq_to_heads(grad, ctx.group)
        return back, None, None


def _check_shapes(x, group, to_heads):
    """Every rank's tensor has the same shape, which the all-to-all can split (one small collective: the
    public functions check; the patched attention, whose step checked its slices once, calls the
    unchecked all-to-all). Raises on every rank alike, so no peer is left waiting in the all-to-all."""
    name = "gather_seq_scatter_heads" if to_heads else "gather_heads_scatter_seq"
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise UlyssesError(f"tfcompat: ulysses.{name}: expected a (tokens, heads, head_dim) tensor, got "
                           f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    p = _size(group)
    mine = torch.tensor(list(x.shape), dtype=torch.int64, device=x.device)
    seen = all_gather(mine, group)
    shapes = [tuple(int(v) for v in t) for t in seen]
    if len(set(shapes)) != 1:
        raise UlyssesError(f"tfcompat: ulysses.{name}: the ranks hold tensors of shapes {shapes}; every rank must "
                           f"hold the same shape (an equal slice of the row: tfcompat.ulysses.slice_for_rank pads "
                           f"the row to a multiple of the group size)")
    split = x.shape[1] if to_heads else x.shape[0]
    if split % p:
        what = "heads" if to_heads else "tokens (the gathered row)"
        raise UlyssesError(f"tfcompat: ulysses.{name}: {split} {what} do not divide over a group of {p} ranks; "
                           + ("repeat the kv heads (repeat_kv_for_group) or choose a group size that divides them"
                              if to_heads else "pass the output of gather_seq_scatter_heads (P x the local tokens)"))


def gather_seq_scatter_heads(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """(s_local, heads, d) on each rank -> (s_local * P, heads / P, d).

    Checks that every rank holds the same shape first (one small collective) and raises
    :class:`UlyssesError` on every rank otherwise."""
    _check_shapes(x, group, True)
    return _AllToAll.apply(x, group, True)


def gather_heads_scatter_seq(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """(s_local * P, heads / P, d) -> (s_local, heads, d); the inverse of :func:`gather_seq_scatter_heads`
    (checked the same way)."""
    _check_shapes(x, group, False)
    return _AllToAll.apply(x, group, False)


def to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """:func:`gather_seq_scatter_heads` without the shape check: for a caller that checked its slices once
    per step (the patched attention; a check per layer would be a host sync per layer)."""
    return _AllToAll.apply(x, group, True)


def to_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """:func:`gather_heads_scatter_seq` without the shape check (see :func:`to_heads`)."""
    return _AllToAll.apply(x, group, False)


def repeat_kv_for_group(k: torch.Tensor, group_size: int) -> torch.Tensor:
    """Repeat kv heads (dim 1 of (s, kv_heads, d)) so they divide over ``group_size`` ranks."""
    kv = k.shape[1]
    if kv % group_size == 0:
        return k
    import math

    rep = math.lcm(kv, group_size) // kv
    return k.repeat_interleave(rep, dim=1)


def padded_length(length: int, group_size: int) -> int:
    return -(-length // group_size) * group_size


def slice_for_rank(x: torch.Tensor, dim: int = 1, group: Any = None, pad_value: float = 0, *,
                   context_group: Any = None) -> torch.Tensor:
    """Pad ``x`` along ``dim`` to a multiple of the group size and return this rank's slice; with
    ``context_group``, this rank's two chunks of the context-parallel layout (see :func:`tfcompat.patch`);
    with both, the Ulysses ``group`` splits each context rank's chunks (the row padded to a multiple of
    ``2 * context size * group size``)."""
    from ._step.context import pad_to, padded_total, slice_rows

    if context_group is not None:
        if group is not None:
            x = pad_to(x, dim, padded_total(x.shape[dim], _size(context_group) * _size(group)), pad_value)
        x = slice_rows(x, dim, context_group, pad_value)
        return x if group is None else slice_for_rank(x, dim, group, pad_value)
    p, rank = _size(group), dist.get_rank(group)
    total = padded_length(x.shape[dim], p)
    x = pad_to(x, dim, total, pad_value)
    step = total // p
    return x.narrow(dim, rank * step, step)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return torch.cat(all_gather(x, group), dim=dim)

    @staticmethod
    def backward(ctx, grad):
        p, rank = _size(ctx.group), dist.get_rank(ctx.group)
        step = grad.shape[ctx.dim] // p
        return grad.narrow(ctx.dim, rank * step, step).contiguous(), None, None


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def gather_from_ranks(x: torch.Tensor, dim: int = 1, group: Any = None, length: Optional[int] = None, *,
                      context_group: Any = None, grad_scale: Any = 1.0) -> torch.Tensor:
    """Concatenate every rank's slice along ``dim`` (and drop padding beyond ``length``); with
    ``context_group``, put every rank's two chunks back in row order (with both: the Ulysses group's
    slices first).

    Backward hands each rank the gradient of its own slice, times ``grad_scale``. The default (1) suits a loss
    that is then SUMMED over the group's ranks (every rank computed the same loss on the gathered tensor and
    the gradients are added, e.g. ``all_reduce(SUM)``). FSDP and DDP AVERAGE gradients over every rank, which
    divides the group's identical contributions by its size: pass ``grad_scale="group"`` (the product of the
    group sizes), as verl's ``gather_outputs_and_unpad`` does by default (its ``grad_scaler=True``).

    .. versionchanged:: 0.2.0 ``grad_scale``.
    """
    if grad_scale == "group":
        grad_scale = (_size(group) if group is not None or context_group is None else 1) * \
            (_size(context_group) if context_group is not None else 1)
    if isinstance(grad_scale, bool) or not isinstance(grad_scale, (int, float)) or not grad_scale > 0:
        raise UlyssesError(f"gather_from_ranks: grad_scale must be a positive number or \"group\", got "
                           f"{grad_scale!r}")
    if grad_scale != 1:
        x = _ScaleGrad.apply(x, float(grad_scale))
    out = _Gather.apply(x, dim, group) if group is not None or context_group is None else x
    if context_group is not None:
        from ._step.context import gather_rows

        out = gather_rows(out, dim, context_group)
    return out if length is None else out.narrow(dim, 0, length)


def slice_inputs(inputs_embeds: torch.Tensor, position_ids: torch.Tensor, *,
                 visual_pos_masks: Optional[torch.Tensor] = None, deepstack_visual_embeds: Optional[list] = None,
                 group: Any = None, context_group: Any = None) -> Any:
    """This rank's share of a packed row, for the text decoder stack of a patched model.

    Args:
        inputs_embeds: (1, total, hidden), e.g. from :func:`tfcompat.embeds.get_input_embeds` on the full row.
        position_ids: (1, total), or (3 or 4, 1, total).
        visual_pos_masks, deepstack_visual_embeds: Qwen3-VL's mask of vision tokens (1, total) and the
            per-layer features of those tokens (num_visual, hidden); each rank keeps the rows of the
            vision tokens that fall in its slice.

    Returns:
        a dict with the same keys, sliced (padded at the end to a multiple of the group size), ready to
        pass as keyword arguments to the text model. Gradients flow back to the full tensors. With
        ``context_group`` (instead of ``group``): this rank's two chunks of the context-parallel layout.
    """
    which = {"group": group, "context_group": context_group}
    out: dict[str, Any] = {
        "inputs_embeds": slice_for_rank(inputs_embeds, dim=1, **which),
        "position_ids": slice_for_rank(position_ids, dim=position_ids.dim() - 1, **which),
    }
    if visual_pos_masks is not None:
        out["visual_pos_masks"] = slice_for_rank(visual_pos_masks, dim=1, pad_value=False, **which)
        if deepstack_visual_embeds is not None:
            # the rows of the vision tokens this rank holds, in its order: index them by their place among
            # the row's vision tokens (each token's rank among them, sliced like the row)
            order = torch.cumsum(visual_pos_masks.to(torch.int64), dim=1) - 1
            mine = slice_for_rank(order, dim=1, pad_value=-1, **which)[out["visual_pos_masks"]]
            out["deepstack_visual_embeds"] = [d.index_select(0, mine) for d in deepstack_visual_embeds]
    return out
