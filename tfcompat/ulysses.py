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

from ._parallel import collectives as _collectives
from ._parallel.collectives import (
    _AllToAll,
    _size,
    all_gather,
    padded_length,
    repeat_kv_for_group,
    slice_for_rank,
)
from ._parallel.shards import slice_inputs  # noqa: F401  (public here)
from .errors import UlyssesError

__all__ = ["UlyssesError", "gather_seq_scatter_heads", "gather_heads_scatter_seq", "slice_for_rank",
           "gather_from_ranks", "repeat_kv_for_group", "padded_length", "slice_inputs"]


def _check_shapes(x, group, heads):
    """Every rank's tensor has the same shape, which the all-to-all can split (one small collective: the
    public functions check; the patched attention, whose step checked its slices once, calls the
    unchecked all-to-all). Raises on every rank alike, so no peer is left waiting in the all-to-all."""
    name = "gather_seq_scatter_heads" if heads else "gather_heads_scatter_seq"
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
    split = x.shape[1] if heads else x.shape[0]
    if split % p:
        what = "heads" if heads else "tokens (the gathered row)"
        raise UlyssesError(f"tfcompat: ulysses.{name}: {split} {what} do not divide over a group of {p} ranks; "
                           + ("repeat the kv heads (repeat_kv_for_group) or choose a group size that divides them"
                              if heads else "pass the output of gather_seq_scatter_heads (P x the local tokens)"))


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
    return _collectives.gather(x, dim, group, length, context_group, grad_scale)
