"""Environment and kernel choices: which packages and torch files exist, which packed-attention kernel and
which RoPE implementation ``auto`` runs per device. Nothing here reads transformers; ``report`` lists these
decisions beside the per-family resolutions.

Imports: the records (``_resolve.Resolution``) and the version reader below it; ``rope``, ``varlen`` and the
CLI above it. torch, triton and flash-attn are imported only where importing is the decision.
"""

import functools
import importlib.util
import os
from typing import Any

from . import _resolve
from . import version as _version

__all__ = ["installed", "torch_ships", "varlen_kernel", "flash_varlen", "triton_kernels", "impl_for", "report"]


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
def varlen_kernel(dropout: bool) -> str:
    """The packed-attention kernel for CUDA fp16/bf16 tensors, decided once: flash-attn where it imports,
    else PyTorch's varlen_attn where torch ships it (no dropout), else the exact SDPA fallback. torch is
    imported only to try flash-attn (it must be imported to know whether it works: often it does not)."""
    if installed("flash_attn") and flash_varlen() is not None:
        return "flash_attn"
    if not dropout and torch_ships("nn/attention/varlen.py"):
        return "torch_varlen"
    return "sdpa"


@functools.lru_cache(maxsize=None)
def triton_kernels():
    """The Triton RoPE kernel module, or the reason it cannot be used (cached: imported once per process)."""
    if not installed("triton"):  # found without importing: absent costs nothing (report imports no torch)
        return "triton is not installed; install triton, or use impl='native' or 'composite'"
    try:
        from ._kernels import rope_triton
    except ImportError as exc:  # no triton (CPU builds of torch do not ship it)
        return f"triton is not importable ({exc}); install triton, or use impl='native' or 'composite'"
    return rope_triton


def impl_for(device: Any) -> str:
    """What ``impl="auto"`` runs on ``device`` ("cpu", "cuda", a torch.device): the decision ``report`` lists.

    CPU: the sliced native kernels (fast in cache). Launch-bound devices (CUDA and others): the fused
    Triton kernel where triton imports (CUDA builds of torch ship it), else the compact composite.
    """
    kind = getattr(device, "type", str(device).split(":")[0])
    if kind == "cpu":
        return "native"
    if kind == "cuda" and not isinstance(triton_kernels(), str):
        return "triton"
    return "composite"


def _varlen_backends():
    cuda = varlen_kernel(False)
    return _resolve.Resolution("varlen.backend", cuda, "", f"packed attention: CUDA fp16/bf16 tensors -> {cuda}; "
                               f"CPU, fp32 or dropout -> sdpa (exact fallback, one fused SDPA call per sequence)",
                               str(_version.transformers_version()))


def _rope_impls():
    cuda = impl_for("cuda")
    why = "triton imports" if cuda == "triton" else "triton does not import"
    return _resolve.Resolution(
        "rope.impl", f"cpu={impl_for('cpu')} cuda={cuda}", "",
        f"apply_rope impl='auto': CPU tensors -> {impl_for('cpu')} (sliced in-cache kernels); CUDA tensors -> "
        f"{cuda} ({why}); under torch.compile or with cos/sin requiring grad -> composite",
        str(_version.transformers_version()))


def report(families=None):
    """The environment's decisions, then every family resolution (:func:`_resolve.report`)."""
    return [_rope_impls(), _varlen_backends()] + _resolve.report(families)
