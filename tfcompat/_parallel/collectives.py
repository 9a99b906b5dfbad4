"""The collectives the sequence-parallel code is built on, written once: every rank's tensor gathered (the
forwards of Ulysses' gather, context parallelism's row and K/V gathers, and the checks' all-gathers of small
shape and fingerprint tensors), Ulysses' all-to-alls, and the two row layouts (Ulysses' contiguous slices,
context parallelism's zigzag chunks) with their slice and gather, sharing ``pad_to``. No validation: the
public ``tfcompat.ulysses`` checks its callers' inputs, the step checks its slices once per step.

Context parallelism's layout ("zigzag", causal load balance): the row, padded to a multiple of ``2 * c``, is cut
into ``2 * c`` equal chunks; rank ``r`` holds chunk ``r`` and chunk ``2c - 1 - r``, in that order.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from ..errors import UlyssesError


def all_gather(x, group):
    """Every rank's ``x`` (equal shapes on every rank), rank after rank, as a list."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return parts


def padded_total(length: int, size: int) -> int:
    """``length`` padded to a multiple of ``2 * size`` (two chunks per rank)."""
    unit = 2 * size
    return -(-length // unit) * unit


def chunks_of(rank: int, size: int, total: int) -> tuple:
    """The (start, end) row ranges rank ``rank`` holds, in its local order (``total``: padded)."""
    m = total // (2 * size)
    return (rank * m, (rank + 1) * m), ((2 * size - 1 - rank) * m, (2 * size - rank) * m)


def pad_to(x: torch.Tensor, dim: int, total: int, pad_value: float = 0) -> torch.Tensor:
    """``x`` padded with ``pad_value`` at the end of ``dim`` to ``total`` entries."""
    n = x.shape[dim]
    if total == n:
        return x
    shape = list(x.shape)
    shape[dim] = total - n
    return torch.cat((x, x.new_full(shape, pad_value)), dim=dim)


def slice_rows(x: torch.Tensor, dim: int, group: Any, pad_value: float = 0) -> torch.Tensor:
    """This rank's two chunks of ``x`` along ``dim`` (padded at the end to a multiple of ``2 * size``)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    total = padded_total(x.shape[dim], size)
    x = pad_to(x, dim, total, pad_value)
    (a, b), (c, d) = chunks_of(rank, size, total)
    return torch.cat((x.narrow(dim, a, b - a), x.narrow(dim, c, d - c)), dim=dim)


def _order(parts, dim, size):
    """Every rank's local tensor (two chunks each) -> the whole row in row order."""
    halves = [p.chunk(2, dim=dim) for p in parts]
    return torch.cat([halves[j][0] for j in range(size)] + [halves[size - 1 - j][1] for j in range(size)], dim=dim)


class _GatherRows(torch.autograd.Function):
    """Every rank's chunks -> the whole row; backward keeps this rank's chunks of the gradient (each rank's
    loss sees the whole row, so parameter gradients summed over the group are the single-process ones)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        parts = all_gather(x, group)
        return _order(parts, dim, len(parts))

    @staticmethod
    def backward(ctx, grad):
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        (a, b), (c, d) = chunks_of(rank, size, grad.shape[ctx.dim])
        out = torch.cat((grad.narrow(ctx.dim, a, b - a), grad.narrow(ctx.dim, c, d - c)), dim=ctx.dim)
        return out.contiguous(), None, None


def gather_rows(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """The whole row from every rank's chunks (the inverse of :func:`slice_rows`, padding kept)."""
    return _GatherRows.apply(x, dim, group)


class _AllGatherSum(torch.autograd.Function):
    """Every rank's tensor, rank after rank along dim 0; backward sums every rank's gradient of this rank's part
    (reduce-scatter on NCCL; an all-reduce on backends without it, e.g. gloo: torch's own all_gather backward
    there addresses subgroups by global rank)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return torch.cat(all_gather(x, group), dim=0)

    @staticmethod
    def backward(ctx, grad):
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        grad = grad.contiguous()
        n = grad.shape[0] // size
        if dist.get_backend(ctx.group) == "nccl":
            out = torch.empty((n, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
            dist.reduce_scatter_tensor(out, grad, group=ctx.group)
            return out, None
        dist.all_reduce(grad, group=ctx.group)
        return grad.narrow(0, rank * n, n).contiguous(), None


def gather_kv(x, group):
    """K or V of the whole row, every rank's gradient summed into the owner's chunks on the way back."""
    size = dist.get_world_size(group)
    return _order(list(_AllGatherSum.apply(x, group).chunk(size, dim=0)), 0, size)


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


def gather(x: torch.Tensor, dim: int, group: Any, length: Optional[int], context_group: Any,
           grad_scale: float) -> torch.Tensor:
    """``tfcompat.ulysses.gather_from_ranks`` after its checks (``grad_scale`` a positive number)."""
    if grad_scale != 1:
        x = _ScaleGrad.apply(x, float(grad_scale))
    out = _Gather.apply(x, dim, group) if group is not None or context_group is None else x
    if context_group is not None:
        out = gather_rows(out, dim, context_group)
    return out if length is None else out.narrow(dim, 0, length)
