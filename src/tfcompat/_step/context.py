"""Context parallelism: a packed row split over the ranks of a ``context_group``, every rank attending its
queries to the keys and values of the whole row (gathered once per layer, llama3-style).

Layout ("zigzag", causal load balance): the row, padded to a multiple of ``2 * c``, is cut into ``2 * c``
equal chunks; rank ``r`` holds chunk ``r`` and chunk ``2c - 1 - r``, in that order. Every rank then does the
same causal work: an early chunk (few keys) and a late one (many keys).

Per attention layer each rank gathers K/V of every rank (an all-gather whose backward sums every rank's
gradient into the owner's slice: a reduce-scatter on NCCL), puts them in row order and attends each
of its query chunks, per packed sequence, to that sequence's keys up to the query (causal, bottom-right
aligned). Exact on every device: one SDPA call per (chunk, sequence) piece with its causal mask, the CPU and
CUDA alike (a varlen or ring kernel for CUDA is not built: its causal alignment needs checking on a GPU).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .._kernels.collectives import all_gather
from ..errors import UlyssesError

__all__ = ["chunks_of", "padded_total", "slice_rows", "gather_rows", "attend"]


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


def _gather_kv(x, group):
    """K or V of the whole row, every rank's gradient summed into the owner's chunks on the way back."""
    size = dist.get_world_size(group)
    return _order(list(_AllGatherSum.apply(x, group).chunk(size, dim=0)), 0, size)


def pieces(step, rank, size, local):
    """Per query chunk of this rank and per packed sequence in it: (local q start, q end, key start, key end),
    where the keys are row positions and the queries attend keys up to their own row position."""
    total = step.total
    out = []
    offset = 0
    bounds = step.bounds
    for a, b in chunks_of(rank, size, total):
        for s0, s1 in zip(bounds[:-1], bounds[1:]):
            lo, hi = max(a, s0), min(b, s1)
            if lo < hi:
                out.append((offset + lo - a, offset + hi - a, s0, hi))
        offset += b - a
    if offset != local:
        raise UlyssesError(f"context parallel: this rank holds {local} tokens but the layout of {total} row tokens "
                           f"over {size} ranks gives it {offset}; slice the row with "
                           f"tfcompat.ulysses.slice_inputs(..., context_group=group)")
    return tuple(out)


def _piece_mask(nq, nk, window, device):
    """Queries at the last ``nq`` of ``nk`` key positions: each sees the keys up to itself (and within the window)."""
    i = torch.arange(nq, device=device)[:, None] + (nk - nq)  # each query's row position, from the piece's first key
    j = torch.arange(nk, device=device)[None, :]
    mask = j <= i
    return mask & (i - j < window) if window is not None else mask


def attend(q, k, v, step, pieces_, group, *, scale, window=None, dropout_p=0.0):
    """Causal attention of this rank's queries (s_local, heads, d) to the whole row's K/V.

    ``pieces_``: :func:`pieces` of the step (computed once per step). Returns (s_local, heads, d)."""
    k_all = _gather_kv(k, group)
    v_all = _gather_kv(v, group)
    extra = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}  # kv heads shared, not copied
    outs = []
    qh, kh, vh = q.transpose(0, 1), k_all.transpose(0, 1), v_all.transpose(0, 1)  # heads first
    key = ("context_masks", window, q.device)
    masks = step.memo.get(key)
    if masks is None:  # once per step (and window): every layer attends the same pieces
        masks = step.memo[key] = [_piece_mask(q1 - q0, k1 - k0, window, q.device) for q0, q1, k0, k1 in pieces_]
    for (q0, q1, k0, k1), mask in zip(pieces_, masks):
        out = torch.nn.functional.scaled_dot_product_attention(
            qh[:, q0:q1].unsqueeze(0), kh[:, k0:k1].unsqueeze(0), vh[:, k0:k1].unsqueeze(0), attn_mask=mask,
            dropout_p=dropout_p, scale=scale, **extra)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs, dim=0)
