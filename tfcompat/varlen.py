"""Attention over packed sequences ("remove padding"): one row of tokens holding several sequences.

Layout: q (total_tokens, heads, head_dim), k/v (total_tokens, kv_heads, head_dim), with
sequence i occupying ``cu_seqlens[i]:cu_seqlens[i+1]``. Queries attend only inside their
own sequence.

``varlen_attention`` calls ``flash_attn_varlen_func`` when flash-attn is importable and
the tensors are on CUDA in fp16/bf16; elsewhere an exact per-sequence
scaled-dot-product fallback computes the same numbers.

.. versionadded:: 0.1.0
"""

import functools

import torch

from .errors import TfcompatError

__all__ = ["cu_seqlens_from_position_ids", "varlen_attention", "flash_attn_available"]


class PackingError(TfcompatError, ValueError):
    """Sequence boundaries that cannot be right (not increasing, not covering the tokens)."""


def cu_seqlens_from_position_ids(position_ids):
    """Sequence boundaries of a packed row from its text position ids.

    Args:
        position_ids: (total,), (1, total), or (4, 1, total) whose row 0 is the text row
            (the layout transformers' VL text models accept). A sequence starts wherever the
            position is 0, or does not continue the previous one (``p[i] != p[i-1] + 1``).

    Returns:
        ``(cu_seqlens, max_seqlen)``: int32 tensor (num_seqs + 1,) on the ids' device, and an int.

    3-row mRoPE ids are refused: a sequence that begins with an image repeats its temporal
    position 0, so boundaries read from them would be wrong. Pass the text row instead.
    """
    ids = position_ids
    if ids.dim() == 3:
        if ids.shape[0] != 4:
            raise PackingError(
                f"cu_seqlens_from_position_ids: got position ids of shape {tuple(ids.shape)}; 3-row mRoPE ids "
                f"cannot mark boundaries (an image at a sequence start repeats position 0); pass the 4-row "
                f"layout (text row first) or the text row itself"
            )
        ids = ids[0]
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise PackingError(f"cu_seqlens_from_position_ids: packed ids have one row, got shape {tuple(ids.shape)}")
        ids = ids[0]
    if ids.numel() == 0:
        raise PackingError("cu_seqlens_from_position_ids: no tokens")
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[1:] = ids[1:] != ids[:-1] + 1
    idx = torch.nonzero(starts).flatten()
    total = torch.tensor([ids.numel()], device=ids.device, dtype=idx.dtype)
    cu = torch.cat((idx, total)).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


@functools.lru_cache(maxsize=None)
def _flash_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # not installed, or built for another torch/CUDA
        return None
    return flash_attn_varlen_func


def flash_attn_available(tensor=None):
    """True when flash-attn's varlen kernel can run (importable, and ``tensor`` on CUDA in fp16/bf16)."""
    if _flash_varlen() is None:
        return False
    return tensor is None or (tensor.is_cuda and tensor.dtype in (torch.float16, torch.bfloat16))


def _check(q, k, v, cu_seqlens):
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise PackingError(
            f"varlen_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be "
            f"(total_tokens, heads, head_dim)"
        )
    if q.shape[1] % k.shape[1]:
        raise PackingError(f"varlen_attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    if int(cu_seqlens[-1]) != q.shape[0] or int(cu_seqlens[0]) != 0:
        raise PackingError(
            f"varlen_attention: cu_seqlens runs from {int(cu_seqlens[0])} to {int(cu_seqlens[-1])} but q has "
            f"{q.shape[0]} tokens; boundaries must start at 0 and end at the token count"
        )


def varlen_attention(q, k, v, cu_seqlens, max_seqlen=None, *, causal=True, softmax_scale=None,
                     window=None, dropout_p=0.0):
    """Attention inside each packed sequence.

    Args:
        q: (total, heads, head_dim); k, v: (total, kv_heads, head_dim) (GQA: heads % kv_heads == 0).
        cu_seqlens: int32 (num_seqs + 1,) boundaries; max_seqlen: longest sequence (computed if None).
        causal: mask future tokens; softmax_scale: default ``head_dim ** -0.5``.
        window: sliding-window size (a query sees at most the ``window`` most recent keys), or None.

    Returns:
        (total, heads, head_dim).
    """
    _check(q, k, v, cu_seqlens)
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    flash = _flash_varlen()
    if flash is not None and flash_attn_available(q):
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        win = (-1, -1) if window is None else (window - 1, 0)
        return flash(q, k, v, cu, cu, max_seqlen, max_seqlen, dropout_p=dropout_p, softmax_scale=scale,
                     causal=causal, window_size=win)
    return _sdpa_fallback(q, k, v, cu_seqlens, scale, causal, window, dropout_p)


def _sdpa_fallback(q, k, v, cu_seqlens, scale, causal, window, dropout_p):
    groups = q.shape[1] // k.shape[1]
    bounds = cu_seqlens.tolist()
    outs = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        qs = q[lo:hi].transpose(0, 1)  # (heads, len, d)
        ks = k[lo:hi].transpose(0, 1)
        vs = v[lo:hi].transpose(0, 1)
        if groups > 1:
            ks = ks.repeat_interleave(groups, dim=0)
            vs = vs.repeat_interleave(groups, dim=0)
        mask = None
        n = hi - lo
        if window is not None:
            i = torch.arange(n, device=q.device)
            dist = i[:, None] - i[None, :]
            mask = (dist >= 0) & (dist < window) if causal else dist.abs() < window
        out = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, dropout_p=dropout_p, is_causal=causal and mask is None, scale=scale)
        outs.append(out.transpose(0, 1))
    return torch.cat(outs, dim=0)
