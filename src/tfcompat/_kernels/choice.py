"""Which kernel serves a call: the kernel table's rows (``table``) filtered by what this machine has (packages
found without importing them, torch's own files, flash-attn's and torch's varlen signatures against tfcompat's
call), decided once per process. Pure environment reads: nothing of transformers, so the kernels' room can ask it
(``_probe.backends`` re-exports it for ``report``)."""

import functools
import importlib.util
import os
from typing import Any

__all__ = ["installed", "torch_ships", "torch_varlen_signature", "torch_varlen_params", "varlen_unfit", "varlen_kernel",
           "unavailable", "select", "flash_varlen", "triton_kernels", "impl_for"]


def installed(package):
    """Whether a top-level package is installed (found on the path, not imported)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


@functools.lru_cache(maxsize=None)
def torch_ships(path):
    """Whether the installed torch has the file ``path`` (relative to its package), read without importing it."""
    spec = importlib.util.find_spec("torch")
    return bool(spec and spec.origin) and os.path.exists(os.path.join(os.path.dirname(spec.origin), path))


@functools.lru_cache(maxsize=None)
def flash_varlen():
    """flash-attn's ``flash_attn_varlen_func``, or None where it is absent or does not import."""
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # not installed, or built for another torch/CUDA
        return None
    return flash_attn_varlen_func


@functools.lru_cache(maxsize=None)
def torch_varlen_signature():
    """The installed torch's ``varlen_attn`` signature, read from its file (None where torch does not ship it)."""
    from . import attention_calls

    if not torch_ships("nn/attention/varlen.py"):
        return None
    spec = importlib.util.find_spec("torch")
    path = os.path.join(os.path.dirname(spec.origin), "nn", "attention", "varlen.py")
    return attention_calls.source_signature(path, "varlen_attn")


@functools.lru_cache(maxsize=None)
def torch_varlen_params():
    """The parameter names of the installed torch's ``varlen_attn`` (empty where it is absent)."""
    sig = torch_varlen_signature()
    return frozenset(sig.parameters) if sig is not None else frozenset()


@functools.lru_cache(maxsize=None)
def varlen_unfit():
    """Why each GPU packed-attention kernel is not used ('' for one that is): flash-attn absent or not importable,
    torch without varlen_attn, or a library whose signature no longer takes tfcompat's call (checked once against
    the real function, so a moved upstream signature falls back to the exact SDPA path instead of failing mid-step
    or computing something else)."""
    from . import attention_calls

    why = {}
    if not installed("flash_attn"):
        why["flash_attn"] = "flash-attn is not installed"
    elif flash_varlen() is None:
        why["flash_attn"] = "flash-attn is installed but does not import (built for another torch or CUDA?)"
    else:
        unfit = attention_calls.fits(flash_varlen(), "flash_attn")
        why["flash_attn"] = f"flash_attn_varlen_func does not take tfcompat's call: {unfit}" if unfit else ""
    sig = torch_varlen_signature()
    if sig is None:
        why["torch_varlen"] = "this torch has no torch.nn.attention.varlen (torch >= 2.10 has it)"
    else:
        unfit = attention_calls.fits(sig, "torch_varlen")
        why["torch_varlen"] = f"torch's varlen_attn does not take tfcompat's call: {unfit}" if unfit else ""
    return why


@functools.lru_cache(maxsize=None)
def varlen_kernel(dropout: bool) -> str:
    """The packed-attention kernel for CUDA fp16/bf16 tensors, decided once from the kernel table: flash-attn where
    it imports and its signature takes tfcompat's call, else PyTorch's varlen_attn likewise (no dropout), else the
    exact SDPA fallback. torch is imported only to try flash-attn (it must be imported to know whether it works:
    often it does not)."""
    return select("varlen", "cuda", "bfloat16", dropout)


def unavailable(op: str, name: str) -> str:
    """Why a kernel of the table cannot run here ('' when it can)."""
    if op == "rope" and name == "triton":
        mod = triton_kernels()
        return mod if isinstance(mod, str) else ""
    if op == "varlen" and name in ("flash_attn", "torch_varlen"):
        return varlen_unfit()[name]
    return ""


def select(op: str, device: Any, dtype: Any = None, dropout: bool = False) -> str:
    """What ``auto`` runs for ``op`` ("rope", "varlen") on ``device`` with ``dtype``: the available row of the
    kernel table (``_kernels.table``) of highest priority that serves them. A GPU kernel then still proves itself
    on first use (``table.first_use``)."""
    kind = getattr(device, "type", str(device).split(":")[0])
    return _select(op, kind, None if dtype is None else str(dtype).replace("torch.", ""), dropout)


# a decision of the process, not of the traced values: torch.compile takes its result as a constant (what
# torch.compiler.assume_constant_result sets, torch 2.7-2.13) instead of tracing through its cache
select._dynamo_marked_constant = True  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=None)
def _select(op, kind, dtype, dropout):
    """``select`` per (op, device kind, dtype name, dropout), decided once (``impl_for`` runs per apply_rope call);
    what it reads is decided once per process too (``triton_kernels``, ``varlen_unfit``)."""
    from . import table

    for row in table.rows(op):
        if not ("*" in row.devices or kind in row.devices) or (row.dtypes and dtype not in row.dtypes):
            continue
        if (dropout and row.name == "torch_varlen") or unavailable(op, row.name):
            continue
        return row.name
    raise AssertionError(f"the kernel table has no fallback for {op} on {kind}")  # every op ends in a "*" row


@functools.lru_cache(maxsize=None)
def triton_kernels():
    """The Triton RoPE kernel module, or the reason it cannot be used (cached: imported once per process)."""
    if not installed("triton"):  # found without importing: absent costs nothing (report imports no torch)
        return "triton is not installed; install triton, or use impl='native' or 'composite'"
    try:
        from . import rope_triton
    except ImportError as exc:  # no triton (CPU builds of torch do not ship it)
        return f"triton is not importable ({exc}); install triton, or use impl='native' or 'composite'"
    return rope_triton


def impl_for(device: Any) -> str:
    """What ``apply_rope(impl="auto")`` runs on ``device`` ("cpu", "cuda", a torch.device): the decision ``report``
    lists, from the kernel table.

    CPU: the sliced native kernels (fast in cache). CUDA: the fused Triton kernel where triton imports (CUDA builds
    of torch ship it), else the compact composite; other devices: the composite.
    """
    return select("rope", device)
