"""Environment and kernel choices: which packages and torch files exist, which packed-attention kernel and
which RoPE implementation ``auto`` runs per device. Nothing here reads transformers; ``report`` lists these
decisions beside the per-family resolutions.

Imports: the records (``plans.Resolution``), the version reader and the kernels below it; ``rope``, ``varlen``
and the step above it. torch, triton and flash-attn are imported only where importing is the decision.
"""

import functools
import importlib.util
import os
from typing import Any

from .. import version as _version
from .plans import Resolution

__all__ = ["installed", "torch_ships", "torch_varlen_signature", "torch_varlen_params", "varlen_unfit", "varlen_kernel",
           "unavailable", "select", "flash_varlen", "triton_kernels", "impl_for", "environment"]


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
    from .._kernels import attention_calls

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
    from .._kernels import attention_calls

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
    from .._kernels import table

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
        from .._kernels import rope_triton
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


def _kernel_table():
    from .._kernels import table

    parts = []
    for op in ("rope", "varlen"):
        for row in table.rows(op):
            why = unavailable(op, row.name)
            where = ",".join(row.devices) or "explicit only"
            parts.append(f"{op}.{row.name} [{where}{' ' + '/'.join(row.dtypes) if row.dtypes else ''}, priority "
                         f"{row.priority}{', proves itself on first use' if row.gpu else ''}]"
                         + (f" unavailable: {why}" if why else ""))
    done = table.proven()
    proofs = "; ".join(f"{p['op']}.{p['kernel']} on {p['device']} {p['key']}: "
                       f"{'ok' if p['ok'] else 'FAILED ' + (p['error'] or 'max |diff| %.3g' % p['max_abs_diff'])} "
                       f"({p['seconds'] * 1e3:.1f} ms)" for p in done)
    return Resolution(
        "kernels.table", f"{len(done)} proven" if done else "none proven yet", "",
        "kernel table: " + "; ".join(parts) + ". First-use proofs in this process: " + (proofs or "none yet"),
        str(_version.transformers_version()))


def _varlen_backends():
    cuda = varlen_kernel(False)
    unused = "; ".join(f"not {k}: {v}" for k, v in varlen_unfit().items() if v)
    return Resolution("varlen.backend", cuda, "", f"packed attention: CUDA fp16/bf16 tensors -> {cuda}; "
                               f"CPU, fp32 or dropout -> sdpa (exact fallback, one fused SDPA call per sequence)"
                               + (f"; {unused}" if unused else "") + "; the GPU kernels get equal cu_seqlens_q/k "
                               "only (context-parallel pieces run SDPA: bottom-right causal alignment for cu_q != "
                               "cu_k is checked by bench/gpu_check.py on a GPU)",
                               str(_version.transformers_version()))


def _rope_impls():
    cuda = impl_for("cuda")
    why = "triton imports" if cuda == "triton" else "triton does not import"
    return Resolution(
        "rope.impl", f"cpu={impl_for('cpu')} cuda={cuda}", "",
        f"apply_rope impl='auto': CPU tensors -> {impl_for('cpu')} (sliced in-cache kernels); CUDA tensors -> "
        f"{cuda} ({why}); under torch.compile or with cos/sin requiring grad -> composite",
        str(_version.transformers_version()))


def environment():
    """The environment's decisions (RoPE implementations, packed-attention kernels, the kernel table), as records:
    :func:`tfcompat.report` lists them before every family resolution."""
    return [_rope_impls(), _varlen_backends(), _kernel_table()]
