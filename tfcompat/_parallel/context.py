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

import torch

from ..errors import UlyssesError
from .collectives import chunks_of, gather_kv

__all__ = ["pieces", "attend"]


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
    k_all = gather_kv(k, group)
    v_all = gather_kv(v, group)
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
