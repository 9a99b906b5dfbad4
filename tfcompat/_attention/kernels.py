"""Packed attention's kernels: the dispatch every patched attention layer calls (``_varlen``), flash-attn's and
torch's varlen kernels (called with the arguments ``gpu_calls`` builds, proven on first use), the exact SDPA
path (one fused call per sequence; one masked call under torch.compile), and what a traced graph calls
(``traced_kernel``). Inputs arrive validated: ``tfcompat.varlen`` checks them (the public face).
"""

from __future__ import annotations

import functools

import torch

from . import kernel_choice as _choice
from .cu import check_cu_seqlens

_HALF = (torch.float16, torch.bfloat16)
#: the kernel table's packed-attention rows by name (each carries its available(), call and proof)
_ROWS = _choice.BY_NAME


def _kind(q, dropout_p):
    """The kernel ``_varlen`` starts from for q: a GPU kernel for CUDA fp16/bf16, else the SDPA path."""
    return _choice.varlen_kernel(dropout_p != 0.0) if q.is_cuda and q.dtype in _HALF else "sdpa"


def _gpu_row(q, k, v, dropout_p):
    """The GPU row that would serve q, k, v (None: the SDPA path): the chosen kernel, unless the heads are ones
    the kernels do not take (the exact path then, not a failed proof: nothing to report)."""
    row = _ROWS[_kind(q, dropout_p)]
    if not row.gpu:
        return None
    from . import gpu_calls as calls

    return None if calls.unfit_shapes(q, k, v) else row


def _varlen(q, k, v, cu_seqlens, bounds, max_seqlen, *, causal, softmax_scale, window, dropout_p):
    """Validated inputs: ``bounds`` are cu_seqlens as Python ints (computed once per step by the caller), or None
    where a GPU kernel takes them from the device unread (:func:`reads_bounds`; read here only if the kernel
    cannot serve the call after all). What ``tfcompat.varlen_attention`` and compiled layers call (eager
    layers call what :func:`bound` returned)."""
    row = _gpu_row(q, k, v, dropout_p)
    if row is not None:
        # no host sync: cu goes to the device as int32 (the kernels' documented dtype), max_seqlen is the Python
        # int computed once per step. First use in this process proves the kernel against the SDPA path on a
        # piece of this call's tensors (_prove_gpu); after it, one set look-up a call. A kernel that fails the
        # proof is not used (one warning).
        if torch.compiler.is_compiling():  # a compiled layer: the kernel proven before tracing, as its op
            ready = _proven_before_tracing(row.name, q, k, causal, window)  # kind and shapes checked above
        else:
            ready = _choice.passed(row.name, q, k, causal, window) or _prove_gpu(row, q, k, v, causal, softmax_scale,
                                                                               window)
        if ready:
            return _gpu_call(row.name, q, k, v, cu_seqlens.to(device=q.device, dtype=torch.int32), max_seqlen, causal,
                             softmax_scale, window, dropout_p)
    if torch.compiler.is_compiling():
        # traced: one SDPA call under a block-diagonal mask built from cu by tensor ops (upstream's masking), so the
        # graph does not specialise on the sequence count or lengths; eager keeps the per-sequence SDPA calls
        return _sdpa_masked(q, k, v, cu_seqlens, softmax_scale, causal, window, dropout_p)
    if bounds is None:  # the kernel could not serve the call: the SDPA path reads the boundaries (one sync)
        bounds = check_cu_seqlens(cu_seqlens, q.shape[0], "varlen_attention: cu_seqlens")
    return _sdpa_fallback(q, k, v, bounds, softmax_scale, causal, window, dropout_p)


def bound(q, k, v, cu_seqlens, bounds, max_seqlen, *, causal, softmax_scale, window, dropout_p):
    """The packed attention call for every layer of a step whose tensors look like these (device, dtype, heads,
    head_dim, scale, window, dropout): what :func:`_varlen` decides per call, decided once. The kernel is chosen
    and, on its first use in the process, proven; the boundaries go to q's device as int32 once; the kernel's
    arguments are built once. Returns ``attend(q, k, v)``: one call a layer. Eager only (compiled layers call
    :func:`_varlen`)."""
    row = _gpu_row(q, k, v, dropout_p)
    if row is not None and (_choice.passed(row.name, q, k, causal, window) or
                            _prove_gpu(row, q, k, v, causal, softmax_scale, window)):
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        fn, _, kw = row.call(q, k, v, cu, max_seqlen, causal, softmax_scale, window, dropout_p)

        def attend(q, k, v):
            return fn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kw)

        return attend
    if bounds is None:  # the kernel cannot serve the call: the SDPA path reads the boundaries (one sync a step)
        bounds = check_cu_seqlens(cu_seqlens, q.shape[0], "varlen_attention: cu_seqlens")
    return functools.partial(_sdpa_fallback, bounds=bounds, scale=softmax_scale, causal=causal, window=window,
                             dropout_p=dropout_p)


def traced_kernel(q, k, v, causal, window, dropout_p):
    """Inside a region torch.compile traces: the GPU kernel that serves these tensors (flash-attn's varlen function
    or torch's ``varlen_attn``, each a ``torch.library`` op the graph calls), if it passed its first-use proof
    before tracing, else None (one masked SDPA call). No proof runs inside a graph (``table.blocked``)."""
    row = _gpu_row(q, k, v, dropout_p)
    return row.name if row is not None and _proven_before_tracing(row.name, q, k, causal, window) else None


def _proven_before_tracing(kind, q, k, causal, window):
    """Whether ``kind`` passed its proof for this layout before the graph was traced (a constant of the graph);
    if not, one warning saying how to warm up."""
    from .._kernels import table

    if _choice.passed_before_tracing(kind, q.device, q.dtype, q.shape[1], k.shape[1], q.shape[2], causal, window):
        return True
    table.say_traced(f"tfcompat: torch.compile traced a packed attention call before the {kind} kernel proved "
                     f"itself in this process, so the compiled graph runs the SDPA path; call "
                     f"tfcompat.warmup(model, example) (or one eager step) before compiling to have the graph call "
                     f"the {kind} kernel")
    return False


def _sdpa_masked(q, k, v, cu, scale, causal, window, dropout_p):
    """Attention inside each packed sequence as one SDPA call: token i attends key j of its own sequence (j <= i
    when causal, i - j < window with a window). What the patched model runs under torch.compile on the SDPA
    path; equal to :func:`_sdpa_fallback` up to the kernels' rounding (tests/test_compile.py)."""
    pos = torch.arange(q.shape[0], device=q.device)
    seq = torch.searchsorted(cu[1:].to(device=q.device, dtype=torch.long), pos, right=True)
    return _sdpa_by_seq(q, k, v, seq, scale, causal, window, dropout_p)


def _sdpa_by_seq(q, k, v, seq, scale, causal, window, dropout_p):
    """:func:`_sdpa_masked` from every token's sequence number (``seq``, int64 (total,), non-decreasing)."""
    pos = torch.arange(q.shape[0], device=q.device)
    seq = seq.to(q.device)
    mask = seq[:, None] == seq[None, :]
    dist = pos[:, None] - pos[None, :]
    if causal:
        mask = mask & (dist >= 0)
    if window is not None:
        mask = mask & (dist.abs() < window)
    extra = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask, dropout_p=dropout_p, scale=scale, **extra)
    return out.squeeze(0).transpose(0, 1)


def _gpu_call(kind, q, k, v, cu, max_seqlen, causal, scale, window, dropout_p):
    """The GPU row ``kind``'s kernel (flash-attn's or torch's varlen function), called with the arguments its row
    builds (``gpu_calls``; its tests bind them against the libraries' real signatures)."""
    fn, args, kwargs = _ROWS[kind].call(q, k, v, cu, max_seqlen, causal, scale, window, dropout_p)
    return fn(*args, **kwargs)


def _prove_gpu(row, q, k, v, causal, scale, window):
    """The row's first-use proof for this call's layout (``kernel_choice.proven``) against the SDPA path, without
    dropout."""
    return row.proof(row.name, lambda a, b, c, cu, n: _gpu_call(row.name, a, b, c, cu, n, causal, scale, window, 0.0),
                     lambda a, b, c, piece: _sdpa_fallback(a, b, c, piece, scale, causal, window, 0.0),
                     q, k, v, causal, scale, window)


def _sdpa_fallback(q, k, v, bounds, scale, causal, window, dropout_p):
    # 4-D (1, heads, len, d) inputs: SDPA picks its fused kernels (flash on CPU) for them, the math
    # kernel for 3-D ones; kv heads are shared through enable_gqa instead of materialised copies
    extra = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    # one split per tensor (heads first): its backward is one concatenation of the per-sequence gradients,
    # where a slice per sequence would allocate and zero-fill a whole-row gradient for each sequence
    # (plain loops, no comprehensions: every patched attention layer runs this on CPU)
    sizes = []
    for i in range(1, len(bounds)):
        sizes.append(bounds[i] - bounds[i - 1])
    qp, kp, vp = q.transpose(0, 1).split(sizes, dim=1), k.transpose(0, 1).split(sizes, dim=1), \
        v.transpose(0, 1).split(sizes, dim=1)
    outs = []
    for i, n in enumerate(sizes):
        qs, ks, vs = qp[i].unsqueeze(0), kp[i].unsqueeze(0), vp[i].unsqueeze(0)
        mask = None
        if window is not None:
            i = torch.arange(n, device=q.device)
            dist = i[:, None] - i[None, :]
            mask = (dist >= 0) & (dist < window) if causal else dist.abs() < window
        out = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, dropout_p=dropout_p, is_causal=causal and mask is None, scale=scale, **extra)
        outs.append(out.squeeze(0).transpose(0, 1))  # squeeze: select's backward would zero-fill a gradient
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)  # one sequence: no copy of its output
