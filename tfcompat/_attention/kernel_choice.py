"""Which packed-attention kernel serves a call: the varlen rows of the kernel table, each with its
``available()`` (installed, importable, and its signature takes tfcompat's call, checked once against the real
function), its call (the library function and the arguments ``gpu_calls`` builds) and its first-use proof
(:func:`proven`, against the exact SDPA path), decided once per process. No torch at import (``report`` reads
it), nothing of transformers."""

import functools
import importlib.util
import os

from .._kernels import table
from .._kernels.table import Impl, installed, pick, torch_ships
from . import gpu_calls as calls

__all__ = ["ROWS", "BY_NAME", "flash_varlen", "torch_varlen", "torch_varlen_signature", "torch_varlen_params",
           "torch_takes_gqa", "varlen_unfit", "varlen_kernel", "passed", "passed_before_tracing", "proven"]


@functools.lru_cache(maxsize=None)
def flash_varlen():
    """flash-attn's ``flash_attn_varlen_func``, or None where it is absent or does not import."""
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # not installed, or built for another torch/CUDA
        return None
    return flash_attn_varlen_func


#: flash-attn 3's varlen function (``flash_attn_interface``, Hopper builds), looked up once: a global, as _FLASH
_FLASH3 = None


def flash3_varlen():
    """flash-attn 3's ``flash_attn_interface.flash_attn_varlen_func``, or None where it is absent or does not
    import."""
    global _FLASH3
    if _FLASH3 is None:
        try:
            from flash_attn_interface import flash_attn_varlen_func
        except Exception:  # not installed, or built for another torch/CUDA
            return None
        _FLASH3 = flash_attn_varlen_func
    return _FLASH3


def _hopper():
    """Why this machine's GPU cannot run flash-attn 3 ('' on a Hopper GPU: compute capability 9.x)."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    return "" if major == 9 else f"flash-attn 3 runs on Hopper (sm_90); this GPU is sm_{major}{minor}"


#: torch's varlen function, looked up by the first call: held in a global, not an ``lru_cache``, because compiled
#: layers call :func:`torch_varlen` (dynamo traces through a cache wrapper and warns that it ignores it)
_TORCH_VARLEN = None


def torch_varlen():
    """PyTorch's ``varlen_attn`` (torch 2.10+), imported on first use: importing it loads torch._dynamo
    (~2 s), which ``report`` and CPU runs need not pay; whether torch ships it is read from its files."""
    global _TORCH_VARLEN
    if _TORCH_VARLEN is not None:
        return _TORCH_VARLEN
    import torch

    from ..errors import TfcompatError

    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception as exc:
        raise TfcompatError(f"varlen_attention: torch {torch.__version__} ships torch.nn.attention.varlen but it "
                            f"does not import ({exc}); repair the torch install") from None
    _TORCH_VARLEN = varlen_attn
    return varlen_attn


@functools.lru_cache(maxsize=None)
def torch_varlen_signature():
    """The installed torch's ``varlen_attn`` signature, read from its file (None where torch does not ship it)."""
    if not torch_ships("nn/attention/varlen.py"):
        return None
    spec = importlib.util.find_spec("torch")
    path = os.path.join(os.path.dirname(spec.origin), "nn", "attention", "varlen.py")
    return calls.source_signature(path, "varlen_attn")


@functools.lru_cache(maxsize=None)
def torch_varlen_params():
    """The parameter names of the installed torch's ``varlen_attn`` (empty where it is absent)."""
    sig = torch_varlen_signature()
    return frozenset(sig.parameters) if sig is not None else frozenset()


def torch_takes_gqa():
    """Whether the installed ``varlen_attn`` takes ``enable_gqa`` (2.13; 2.11 shares kv heads itself), read once
    from torch's file: a constant of the graph under torch.compile, which cannot trace the file read (dynamo:
    "Attempted to call function marked as skipped", seen on an H200, torch 2.11)."""
    return "enable_gqa" in torch_varlen_params()


torch_takes_gqa._dynamo_marked_constant = True  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=None)
def varlen_unfit():
    """Why each GPU packed-attention kernel is not used ('' for one that is): flash-attn absent or not importable,
    torch without varlen_attn, or a library whose signature no longer takes tfcompat's call (checked once against
    the real function, so a moved upstream signature falls back to the exact SDPA path instead of failing mid-step
    or computing something else)."""
    why = {}
    if not installed("flash_attn"):
        why["flash_attn"] = "flash-attn is not installed"
    elif flash_varlen() is None:
        why["flash_attn"] = "flash-attn is installed but does not import (built for another torch or CUDA?)"
    else:
        unfit = calls.fits(flash_varlen(), "flash_attn")
        why["flash_attn"] = f"flash_attn_varlen_func does not take tfcompat's call: {unfit}" if unfit else ""
    if not installed("flash_attn_interface"):
        why["flash_attn_3"] = "flash-attn 3 (flash_attn_interface, Hopper) is not installed"
    elif flash3_varlen() is None:
        why["flash_attn_3"] = "flash_attn_interface is installed but does not import (built for another torch or CUDA?)"
    else:
        unfit = calls.fits(flash3_varlen(), "flash_attn_3")
        why["flash_attn_3"] = f"flash_attn_interface.flash_attn_varlen_func does not take tfcompat's call: {unfit}" \
            if unfit else _hopper()
    sig = torch_varlen_signature()
    if sig is None:
        why["torch_varlen"] = "this torch has no torch.nn.attention.varlen (torch >= 2.10 has it)"
    else:
        unfit = calls.fits(sig, "torch_varlen")
        why["torch_varlen"] = f"torch's varlen_attn does not take tfcompat's call: {unfit}" if unfit else ""
    return why


#: flash-attn's varlen function, looked up by the first eager call: a graph reads it as a global (dynamo cannot
#: trace the look-up's import where flash-attn fails to import: "Import failure")
_FLASH = None


def _flash_call(q, k, v, cu, max_seqlen, causal, scale, window, dropout_p):
    """flash-attn's row: ``flash_attn_varlen_func`` and its arguments."""
    global _FLASH
    if _FLASH is None:  # eager, once: a graph calls flash-attn only after an eager call proved it
        _FLASH = flash_varlen()
    args, kwargs = calls.flash_call(q, k, v, cu, max_seqlen, causal=causal, scale=scale, window=window,
                                    dropout_p=dropout_p, deterministic=calls.deterministic())
    return _FLASH, args, kwargs


def _fa3(*args, **kwargs):
    """flash-attn 3's call, its output only (a build may return the log-sum-exp beside it)."""
    return calls.first_output(flash3_varlen()(*args, **kwargs))


def _flash3_call(q, k, v, cu, max_seqlen, causal, scale, window, dropout_p):
    """flash-attn 3's row (no dropout: the row does not serve it)."""
    args, kwargs = calls.flash3_call(q, k, v, cu, max_seqlen, causal=causal, scale=scale, window=window,
                                     deterministic=calls.deterministic())
    return _fa3, args, kwargs


def _torch_call(q, k, v, cu, max_seqlen, causal, scale, window, dropout_p):
    """torch's row: ``varlen_attn`` and its arguments (no dropout: the row does not serve it)."""
    args, kwargs = calls.torch_call(q, k, v, cu, max_seqlen, causal=causal, scale=scale, window=window,
                                    params=("enable_gqa",) if torch_takes_gqa() else ())
    return torch_varlen(), args, kwargs


# The first-use proof of the GPU rows (flash-attn's and torch's varlen kernels), beside ``_rope.fused_proof`` for the
# RoPE kernel: once per (kernel, device, dtype, heads, head_dim, causal, window) in a process, a piece of the call's
# own tensors runs through the kernel and the exact SDPA path, forward and backward (``table.first_use``); after it,
# one set look-up a call (``passed``).

def _fast(kind, q, k, causal, window):
    return ("varlen", kind, q.device, q.dtype, q.shape[1], k.shape[1], q.shape[2], bool(causal), window)


def passed(kind, q, k, causal, window):
    """Whether this (kernel, device, dtype, heads, head_dim, causal, window) passed its first-use proof: the
    per-call check, one set look-up."""
    return table.passed(_fast(kind, q, k, causal, window))


def passed_before_tracing(kind, device, dtype, heads, kv_heads, head_dim, causal, window):
    """:func:`passed` from code torch.compile traces, by plain values (the tensors' device, dtype and sizes): dynamo
    calls it once while tracing and keeps the answer as a constant of the graph, so a kernel proven before
    compiling (an eager call, ``tfcompat.warmup``) is called as the op it is registered as, with no guard on the
    proof table. A kernel first proven after the graph was built serves the next graph built."""
    return table.passed(("varlen", kind, device, dtype, heads, kv_heads, head_dim, bool(causal), window))


# what torch.compiler.assume_constant_result sets (torch 2.7-2.13), without importing torch._dynamo here
passed_before_tracing._dynamo_marked_constant = True  # type: ignore[attr-defined]


def proven(kind, call, reference, q, k, v, causal, scale, window):
    """First use proves a GPU attention kernel (``table.first_use``): for this (kernel, device, dtype, heads,
    head_dim, causal, window), once per process, a piece of the call's own q, k, v (two sequences: 16 tokens, and
    one 16 longer than the window; every head) runs through ``call(q, k, v, cu, max_len)`` and through
    ``reference(q, k, v, bounds)`` (the exact SDPA path, in fp32), forward and backward. False: the caller runs the
    reference path instead."""
    import torch

    fast = _fast(kind, q, k, causal, window)
    if table.passed(fast):  # proven earlier in this process: one set look-up a call
        return True
    key = (str(q.dtype)[6:],) + fast[4:]
    if q.shape[0] == 0:
        return False  # an empty call proves nothing: the exact path serves it, nothing is recorded
    # two sequences: a short one, and one longer than the window by 16 keys (so a kernel that ignores the window,
    # or counts it off by one, differs); every head of q, k and v. A row shorter than that is repeated to reach it:
    # the key proven here serves later calls with longer sequences
    n = 16 + (32 if window is None else window + 16)
    bounds = [0, 16, n]

    def both_ways(fn, dtype):
        # built here, inside the proof: a key that failed its proof reaches proven() on every call
        take = torch.arange(n, device=q.device) % q.shape[0]
        grad_out = torch.randn((n, q.shape[1], v.shape[-1]), generator=torch.Generator().manual_seed(0))
        # copies: the caller's tensors may be inference tensors (a rollout), which cannot require gradients
        pieces = [t.detach().index_select(0, take).to(dtype, copy=True).requires_grad_(True) for t in (q, k, v)]
        with torch.enable_grad():
            out = fn(*pieces)
            # the output's own shape (v's head_dim), the same values into both backwards
            grads = torch.autograd.grad(out, pieces, grad_out.to(device=out.device, dtype=out.dtype))
        return (out, *grads)

    def run():
        cu = torch.tensor(bounds, dtype=torch.int32, device=q.device)
        longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        return both_ways(lambda a, b, c: call(a, b, c, cu, longest), q.dtype)

    def ref():
        return both_ways(lambda a, b, c: reference(a, b, c, bounds), torch.float32)

    return table.first_use("varlen", kind, q.device, key, run, ref, False, fast)


#: the packed-attention rows, highest priority first
ROWS = (
    Impl("varlen", "flash_attn_3", ("cuda",), ("float16", "bfloat16"), 40, True,
         "flash_attn_interface.flash_attn_varlen_func (Hopper; no dropout)", dropout=False,
         available=lambda: varlen_unfit()["flash_attn_3"], call=_flash3_call, proof=proven),
    Impl("varlen", "flash_attn", ("cuda",), ("float16", "bfloat16"), 30, True, "flash_attn_varlen_func",
         available=lambda: varlen_unfit()["flash_attn"], call=_flash_call, proof=proven),
    Impl("varlen", "torch_varlen", ("cuda",), ("float16", "bfloat16"), 20, True,
         "torch.nn.attention.varlen.varlen_attn (no dropout)", dropout=False,
         available=lambda: varlen_unfit()["torch_varlen"], call=_torch_call, proof=proven),
    Impl("varlen", "sdpa", ("*",), None, 0, False, "exact: one fused SDPA call per sequence"),
)

#: the rows by name
BY_NAME = {row.name: row for row in ROWS}


@functools.lru_cache(maxsize=None)
def _select(kind, dtype, dropout):
    return pick(ROWS, kind, dtype, dropout)


def select(device, dtype=None, dropout=False):
    """What packed attention runs on ``device`` with ``dtype`` under ``auto``: the available row of highest priority
    that serves them (decided once per device kind, dtype and dropout)."""
    return _select(getattr(device, "type", str(device).split(":")[0]),
                   None if dtype is None else str(dtype).replace("torch.", ""), bool(dropout))


select._dynamo_marked_constant = True  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=None)
def varlen_kernel(dropout: bool) -> str:
    """The packed-attention kernel for CUDA fp16/bf16 tensors, decided once from the kernel table: flash-attn where
    it imports and its signature takes tfcompat's call, else PyTorch's varlen_attn likewise (no dropout), else the
    exact SDPA fallback. torch is imported only to try flash-attn (it must be imported to know whether it works:
    often it does not)."""
    return select("cuda", "bfloat16", dropout)
