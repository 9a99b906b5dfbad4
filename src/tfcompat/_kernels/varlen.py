"""Packed attention's kernels: the dispatch every patched attention layer calls (``_varlen``), flash-attn's and
torch's varlen kernels (called with the arguments ``attention_calls`` builds, proven on first use), the exact SDPA
path (one fused call per sequence; one masked call under torch.compile), and what a traced graph calls
(``traced_kernel``). Inputs arrive validated: ``tfcompat.varlen`` checks them (the public face).
"""

from __future__ import annotations

import functools

import torch

from ..errors import TfcompatError
from . import attention_proof as proofs
from . import choice as _choice
from .cu import check_cu_seqlens

_HALF = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def _torch_varlen():
    """PyTorch's ``varlen_attn`` (torch 2.10+), imported on first use: importing it loads torch._dynamo
    (~2 s), which ``report`` and CPU runs need not pay; whether torch ships it is read from its files."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception as exc:
        raise TfcompatError(f"varlen_attention: torch {torch.__version__} ships torch.nn.attention.varlen but it "
                            f"does not import ({exc}); repair the torch install") from None
    return varlen_attn


def _kind(q, dropout_p):
    """The kernel ``_varlen`` starts from for q: a GPU kernel for CUDA fp16/bf16, else the SDPA path."""
    return _choice.varlen_kernel(dropout_p != 0.0) if q.is_cuda and q.dtype in _HALF else "sdpa"


def _varlen(q, k, v, cu_seqlens, bounds, max_seqlen, *, causal, softmax_scale, window, dropout_p):
    """Validated inputs: ``bounds`` are cu_seqlens as Python ints (computed once per step by the caller), or None
    where a GPU kernel takes them from the device unread (:func:`reads_bounds`; read here only if the kernel
    cannot serve the call after all). Every patched attention layer calls this: CPU tensors go straight to the
    SDPA path (no helper calls)."""
    kind = _kind(q, dropout_p)
    if kind != "sdpa":
        from . import attention_calls as calls

        if calls.unfit_shapes(q, k, v):
            kind = "sdpa"  # heads the kernels do not take: the exact path, not a failed proof (nothing to report)
    if kind != "sdpa":
        # no host sync: cu goes to the device as int32 (the kernels' documented dtype), max_seqlen is the Python
        # int computed once per step. First use in this process proves the kernel against the SDPA path on a
        # piece of this call's tensors (_prove_gpu); after it, one set look-up a call. A kernel that fails the
        # proof is not used (one warning).
        if torch.compiler.is_compiling():  # a compiled layer: the kernel proven before tracing, as its op
            ready = _proven_before_tracing(kind, q, k, causal, window)  # kind and shapes checked above
        else:
            ready = proofs.passed(kind, q, k, causal, window) or _prove_gpu(kind, q, k, v, causal, softmax_scale,
                                                                           window)
        if ready:
            return _gpu_call(kind, q, k, v, cu_seqlens.to(device=q.device, dtype=torch.int32), max_seqlen, causal,
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
    from . import attention_calls as calls

    kind = _kind(q, dropout_p)
    if kind != "sdpa" and calls.unfit_shapes(q, k, v):
        kind = "sdpa"  # heads the kernels do not take: the exact path, not a failed proof (nothing to report)
    if kind != "sdpa" and (proofs.passed(kind, q, k, causal, window) or
                           _prove_gpu(kind, q, k, v, causal, softmax_scale, window)):
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        if kind == "flash_attn":
            global _FLASH_VARLEN
            if _FLASH_VARLEN is None:
                _FLASH_VARLEN = _choice.flash_varlen()
            fn = _FLASH_VARLEN
            _, kw = calls.flash_call(q, k, v, cu, max_seqlen, causal=causal, scale=softmax_scale, window=window,
                                     dropout_p=dropout_p, deterministic=calls.deterministic())
        else:
            fn = _torch_varlen()
            _, kw = calls.torch_call(q, k, v, cu, max_seqlen, causal=causal, scale=softmax_scale, window=window,
                                     params=("enable_gqa",) if _torch_takes_gqa() else ())

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
    before tracing, else ``"sdpa"`` (one masked SDPA call). No proof runs inside a graph (``table.blocked``)."""
    kind = _kind(q, dropout_p)
    if kind == "sdpa":
        return kind
    from . import attention_calls as calls

    if calls.unfit_shapes(q, k, v):
        return "sdpa"
    return kind if _proven_before_tracing(kind, q, k, causal, window) else "sdpa"


def _proven_before_tracing(kind, q, k, causal, window):
    """Whether ``kind`` passed its proof for this layout before the graph was traced (a constant of the graph);
    if not, one warning saying how to warm up."""
    from . import table

    if proofs.passed_before_tracing(kind, q.device, q.dtype, q.shape[1], k.shape[1], q.shape[2], causal, window):
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
    """flash-attn's or torch's varlen kernel, with the arguments _kernels.attention_calls builds (its tests bind them
    against the libraries' real signatures)."""
    from . import attention_calls as calls

    if kind == "flash_attn":
        args, kwargs = calls.flash_call(q, k, v, cu, max_seqlen, causal=causal, scale=scale, window=window,
                                        dropout_p=dropout_p, deterministic=calls.deterministic())
        global _FLASH_VARLEN
        if _FLASH_VARLEN is None:  # eager, once: a graph calls flash-attn only after an eager call proved it
            _FLASH_VARLEN = _choice.flash_varlen()
        return _FLASH_VARLEN(*args, **kwargs)
    args, kwargs = calls.torch_call(q, k, v, cu, max_seqlen, causal=causal, scale=scale, window=window,
                                    params=("enable_gqa",) if _torch_takes_gqa() else ())
    return _torch_varlen()(*args, **kwargs)


#: flash-attn's varlen function, looked up by the first eager call: a graph reads it as a global (dynamo cannot
#: trace the look-up's import where flash-attn fails to import: "Import failure")
_FLASH_VARLEN = None


def _torch_takes_gqa():
    """Whether the installed ``varlen_attn`` takes ``enable_gqa`` (2.13; 2.11 shares kv heads itself), read once
    from torch's file (``_backends``): a constant of the graph under torch.compile, which cannot trace the file
    read (dynamo: "Attempted to call function marked as skipped", seen on an H200, torch 2.11)."""
    return "enable_gqa" in _choice.torch_varlen_params()


_torch_takes_gqa._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _prove_gpu(kind, q, k, v, causal, scale, window):
    """The first-use proof of ``kind`` for this call's layout (``attention_proof.proven``), without dropout."""
    return proofs.proven(kind, lambda a, b, c, cu, n: _gpu_call(kind, a, b, c, cu, n, causal, scale, window, 0.0),
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
