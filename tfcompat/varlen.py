"""Attention over packed sequences ("remove padding"): one row of tokens holding several sequences.

Layout: q (total_tokens, heads, head_dim), k/v (total_tokens, kv_heads, head_dim), with
sequence i occupying ``cu_seqlens[i]:cu_seqlens[i+1]``. Queries attend only inside their
own sequence.

``varlen_attention`` calls ``flash_attn_varlen_func`` when flash-attn is importable and
the tensors are on CUDA in fp16/bf16; else PyTorch's own ``varlen_attn`` on CUDA where the
installed torch has it; elsewhere an exact per-sequence scaled-dot-product fallback computes
the same numbers (:func:`backend` says which; ``tfcompat report`` lists it).

    >>> import torch
    >>> from tfcompat.varlen import cu_seqlens_from_position_ids, varlen_attention
    >>> cu, longest = cu_seqlens_from_position_ids(torch.tensor([[0, 1, 2, 0, 1]]))
    >>> cu.tolist(), longest
    ([0, 3, 5], 3)
    >>> q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    >>> varlen_attention(q, k, v, cu).shape     # (total_tokens, heads, head_dim), causal per sequence
    torch.Size([5, 4, 8])

.. versionadded:: 0.1.0
"""

from __future__ import annotations

from typing import Optional

import torch

from ._attention.cu import check_cu_seqlens, check_longest
from ._attention.kernels import _HALF, _ROWS, _kind, _varlen  # noqa: F401  (the kernels, below the face)
from ._attention.starts import restarts
from ._probe import backends as _backends
from .errors import PackingError

__all__ = ["PackingError", "cu_seqlens_from_position_ids", "check_cu_seqlens", "varlen_attention",
           "flash_attn_available", "backend"]


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Sequence boundaries of a packed row from its text position ids.

    Args:
        position_ids: (total,), (1, total), or (4, 1, total) whose row 0 is the text row
            (the layout transformers' VL text models accept). A sequence starts wherever the
            position is 0 (transformers' own rule); positions that go down without restarting
            at 0 are refused.

    Returns:
        ``(cu_seqlens, max_seqlen)``: int32 tensor (num_seqs + 1,) on the ids' device, and an int.

    3-row mRoPE ids are refused: a sequence that begins with an image repeats its temporal
    position 0, so boundaries read from them would be wrong. Pass the text row instead.
    """
    ids = position_ids
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point:
        raise PackingError(f"cu_seqlens_from_position_ids: expected an integer tensor, got "
                           f"{getattr(ids, 'dtype', type(ids).__name__)}")
    if ids.dim() == 3:
        if ids.shape[0] != 4 or ids.shape[1] != 1:
            raise PackingError(
                f"cu_seqlens_from_position_ids: got position ids of shape {tuple(ids.shape)}; 3-row mRoPE ids "
                f"cannot mark boundaries (an image at a sequence start repeats position 0); pass the 4-row "
                f"layout (4, 1, total) (text row first) or the text row itself"
            )
        ids = ids[0]
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise PackingError(f"cu_seqlens_from_position_ids: packed ids have one row, got shape {tuple(ids.shape)}")
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise PackingError(f"cu_seqlens_from_position_ids: no tokens, or an unexpected shape {tuple(ids.shape)}")
    starts, i = restarts(ids)
    if i is not None:
        raise PackingError(f"cu_seqlens_from_position_ids: positions go down from {int(ids[i - 1])} to "
                           f"{int(ids[i])} at token {i} without restarting at 0; each sequence must count from 0")
    cu = torch.tensor(starts + [ids.numel()], dtype=torch.int32, device=ids.device)
    return cu, int((cu[1:] - cu[:-1]).max())


def backend(tensor: Optional[torch.Tensor] = None, dropout_p: float = 0.0) -> str:
    """Which kernel ``varlen_attention`` runs for ``tensor`` (None: for a CUDA bf16 tensor).

    "flash_attn": flash-attn's ``flash_attn_varlen_func`` (importable, CUDA, fp16/bf16);
    "torch_varlen": PyTorch's ``torch.nn.attention.varlen.varlen_attn`` (CUDA, fp16/bf16, no dropout);
    "sdpa": the exact fallback, one fused SDPA call per sequence (every device and dtype).
    """
    cuda_half = tensor is None or (tensor.is_cuda and tensor.dtype in _HALF)
    return _backends.varlen_kernel(dropout_p != 0.0) if cuda_half else "sdpa"


def flash_attn_available(tensor: Optional[torch.Tensor] = None) -> bool:
    """True when flash-attn's varlen kernel can run (importable, and ``tensor`` on CUDA in fp16/bf16)."""
    return backend(tensor) == "flash_attn"


def _check(q, k, v, cu_seqlens):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
            raise PackingError(f"varlen_attention: {name} must be a floating-point tensor, got "
                               f"{getattr(t, 'dtype', type(t).__name__)}")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise PackingError(
            f"varlen_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be "
            f"(total_tokens, heads, head_dim)"
        )
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0] or k.shape[1] != v.shape[1] or \
            k.shape[2] != q.shape[2] or q.dtype != k.dtype or q.dtype != v.dtype:
        raise PackingError(
            f"varlen_attention: q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, v {tuple(v.shape)} "
            f"{v.dtype}: packed self-attention needs k and v of q's token count and dtype, equal kv head counts, "
            f"and k of q's head_dim"
        )
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise PackingError(f"varlen_attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")


def reads_bounds(kind: str, cu_device: str, max_seqlen: Optional[int]) -> bool:
    """Whether ``varlen_attention`` reads ``cu_seqlens`` back to the host (one sync where they lie on a GPU).

    Not when a GPU kernel runs with boundaries already on the GPU and ``max_seqlen`` given: the kernel takes
    both as they are, and the boundaries are checked on the device (:func:`assert_cu_on_device`). The SDPA
    path splits the row by Python ints, and without ``max_seqlen`` the longest sequence must be read; boundaries
    on the CPU are read for free and checked with a clear error."""
    return not _ROWS[kind].gpu or cu_device != "cuda" or max_seqlen is None


def assert_cu_on_device(cu_seqlens: torch.Tensor, total: int, max_seqlen: int) -> None:
    """Check boundaries where they lie, without a host read: a 1-D integer tensor from 0 to ``total``, strictly
    increasing, whose longest sequence is ``max_seqlen``. The shape and dtype are refused at once
    (:class:`PackingError`); the values by a device-side assertion (``torch._assert_async``, raised by the
    next synchronising call on a GPU, at once on the CPU) naming tfcompat's check."""
    cu = cu_seqlens
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2 or cu.dtype.is_floating_point or \
            cu.dtype.is_complex or cu.dtype == torch.bool:
        check_cu_seqlens(cu, total, "varlen_attention: cu_seqlens")  # its refusal, with the found shape/dtype
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 1:
        raise PackingError(f"varlen_attention: max_seqlen must be a positive int, got {max_seqlen!r}")
    steps = cu[1:] - cu[:-1]
    ok = (cu[0] == 0) & (cu[-1] == total) & (steps > 0).all() & (steps.max() == max_seqlen)
    torch._assert_async(ok, f"tfcompat varlen_attention: cu_seqlens must run from 0 to the token count {total}, "
                            f"strictly increasing, with max_seqlen {max_seqlen} its longest sequence")


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: Optional[int] = None, *, causal: bool = True, softmax_scale: Optional[float] = None,
                     window: Optional[int] = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Attention inside each packed sequence.

    Args:
        q: (total, heads, head_dim); k, v: (total, kv_heads, head_dim) (GQA: heads % kv_heads == 0).
        cu_seqlens: int32 (num_seqs + 1,) boundaries, from 0 to total, strictly increasing;
            max_seqlen: longest sequence (computed if None; checked if given). On a GPU kernel, boundaries on the
            GPU with ``max_seqlen`` given are not read back (no host sync): they are checked by a device-side
            assertion (:func:`reads_bounds`, :func:`assert_cu_on_device`); otherwise they are read once.
        causal: mask future tokens; softmax_scale: default ``head_dim ** -0.5``.
        window: sliding-window size (a query sees at most the ``window`` most recent keys), or None.

    Returns:
        (total, heads, head_dim).

    Raises:
        PackingError: boundaries or shapes that cannot describe one packed row.
    """
    _check(q, k, v, cu_seqlens)
    if window is not None and (not isinstance(window, int) or window < 1):
        raise PackingError(f"varlen_attention: window must be a positive int or None, got {window!r}")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    device = cu_seqlens.device.type if isinstance(cu_seqlens, torch.Tensor) else "cpu"
    if not reads_bounds(_kind(q, dropout_p), device, max_seqlen):
        # a GPU kernel, the boundaries on the GPU and their longest given: no host sync (checked on the device)
        longest = int(max_seqlen)  # type: ignore[arg-type]
        assert_cu_on_device(cu_seqlens, q.shape[0], longest)
        return _varlen(q, k, v, cu_seqlens, None, longest, causal=causal, softmax_scale=scale, window=window,
                       dropout_p=dropout_p)
    bounds = check_cu_seqlens(cu_seqlens, q.shape[0], "varlen_attention: cu_seqlens")
    longest = check_longest(bounds, max_seqlen, "varlen_attention")
    return _varlen(q, k, v, cu_seqlens, bounds, longest, causal=causal, softmax_scale=scale, window=window,
                   dropout_p=dropout_p)


