"""Which RoPE implementation serves a call, and one rotation of q and k by one (cos, sin), decided and prepared once.

The RoPE rows of the kernel table (``ROWS``), each with its ``available()`` and its proof, filtered by what this
machine has (triton found without importing it, imported once), decided once per process (:func:`select`,
:func:`impl_for`). No torch at import (``report`` reads the rows), nothing of transformers.

:class:`Rotation` chooses the implementation (by device, the RoPE rows of the kernel table and their first-use
proof, torch.compile, gradients through cos/sin), folds the mRoPE sections, casts cos/sin to q's dtype, splits or
signs them for the kernel, and binds the kernel's call, all in its constructor; calling it rotates, with no
choosing. ``apply_rope`` builds one per call; the patched attention builds one per packed step and (q, k) layout
and every layer calls it (``_attention.bundled.for_layers``). Beside the RoPE kernels: it reads no transformers (the
``rope.apply`` resolution arrives as an argument).
"""

from __future__ import annotations

import functools
import os
from typing import Any

from .._kernels.table import SAID as _SAID  # noqa: F401  (the said messages: tests clear some)
from .._kernels.table import Impl, installed, pick
from .._kernels.table import say_once as _say_once
from .._kernels.table import say_traced as _say_traced
from ..errors import ConfigError, RopeShapeError

__all__ = ["ROWS", "BY_NAME", "triton_kernels", "select", "impl_for", "IMPLS", "chosen_impl", "upstream",
           "Rotation"]


@functools.lru_cache(maxsize=None)
def triton_kernels():
    """The Triton RoPE kernel module, or the reason it cannot be used (cached: imported once per process)."""
    if not installed("triton"):  # found without importing: absent costs nothing (report imports no torch)
        return "triton is not installed; install triton, or use impl='native' or 'composite'"
    try:
        from . import fused
    except ImportError as exc:  # no triton (CPU builds of torch do not ship it)
        return f"triton is not importable ({exc}); install triton, or use impl='native' or 'composite'"
    return fused


def _triton_unfit():
    mod = triton_kernels()
    return mod if isinstance(mod, str) else ""


def _triton_proof(*args):
    """``fused_proof.proven`` (it imports triton: imported when a Triton rotation is first built)."""
    from .fused_proof import proven

    return proven(*args)


#: the RoPE rows, highest priority first
ROWS = (
    Impl("rope", "triton", ("cuda",), None, 30, True, "one fused Triton launch for q and k, forward and backward",
         available=_triton_unfit, proof=_triton_proof),
    Impl("rope", "native", ("cpu",), None, 20, False, "sliced in-cache kernels"),
    Impl("rope", "composite", ("*",), None, 10, False, "10-14 tensor ops; what torch.compile traces"),
    Impl("rope", "upstream", (), None, 0, False, "the installed transformers' own function (explicit only)"),
)

#: the rows by name
BY_NAME = {row.name: row for row in ROWS}


@functools.lru_cache(maxsize=None)
def _select(kind, dtype):
    return pick(ROWS, kind, dtype, False)


def select(device: Any, dtype: Any = None, dropout: bool = False) -> str:
    """What ``apply_rope(impl="auto")`` runs on ``device``: the available RoPE row of highest priority that serves
    it (decided once per device kind). A GPU kernel then still proves itself on first use. (``dropout``: the
    signature every op's choice shares; no RoPE row has any.)"""
    return _select(getattr(device, "type", str(device).split(":")[0]),
                   None if dtype is None else str(dtype).replace("torch.", ""))


# a decision of the process, not of the traced values: torch.compile takes its result as a constant (what
# torch.compiler.assume_constant_result sets, torch 2.7-2.13) instead of tracing through its cache
select._dynamo_marked_constant = True  # type: ignore[attr-defined]


def impl_for(device: Any) -> str:
    """What ``apply_rope(impl="auto")`` runs on ``device`` ("cpu", "cuda", a torch.device): the decision ``report``
    lists, from the kernel table.

    CPU: the sliced native kernels (fast in cache). CUDA: the fused Triton kernel where triton imports (CUDA builds
    of torch ship it), else the compact composite; other devices: the composite.
    """
    return select(device)


IMPLS = ("auto", "native", "composite", "triton", "upstream")


def chosen_impl(impl):
    """``impl`` as given, else ``TFCOMPAT_ROPE_IMPL``, else "auto"; anything else is a ConfigError."""
    chosen = impl if impl is not None else os.environ.get("TFCOMPAT_ROPE_IMPL", "auto")
    if chosen not in IMPLS:
        source = "impl=" if impl is not None else "TFCOMPAT_ROPE_IMPL="
        raise ConfigError(f"apply_rope: {source}{chosen!r} is not one of {', '.join(IMPLS)}")
    return chosen


KERNELS = ("native", "composite", "triton")  # tfcompat's own rotations; "upstream" and "auto" are not a choice of one


def kernel_chosen_by_environment():
    """The tfcompat rotation ``TFCOMPAT_ROPE_IMPL`` names (native, composite or triton), else None. ``patch`` reads it:
    a model patched while it names one keeps tfcompat's bundled attention forward, which rotates with that kernel
    (upstream's forward, on the interface route, rotates with upstream's function)."""
    chosen = chosen_impl(None)
    return chosen if chosen in KERNELS else None


def compiling():
    import torch

    return torch.compiler.is_compiling()


def upstream(res, q, k, cos, sin, section, unsqueeze_dim):
    """The installed transformers' own rotary function (``res``: the ``rope.apply`` resolution), called as its
    attention calls it."""
    if res.plan.cos_rows == 3:
        return res.target(q, k, cos, sin, list(section or ()), unsqueeze_dim=unsqueeze_dim)
    if res.plan.single:
        return (res.target(q, cos, sin, unsqueeze_dim=unsqueeze_dim),
                res.target(k, cos, sin, unsqueeze_dim=unsqueeze_dim))
    return res.target(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


def _triton_for(name, q):
    mod = triton_kernels()
    if isinstance(mod, str):
        raise ConfigError(f"apply_rope for {name}: impl='triton' but {mod}")
    if q.device.type != "cuda" and not (q.device.type == "cpu" and mod.interpreted()):
        raise ConfigError(f"apply_rope for {name}: impl='triton' runs on CUDA tensors, q is on {q.device}; "
                          f"on CPU Triton runs only in its interpreter (TRITON_INTERPRET=1 set before triton is "
                          f"imported: slow, for tests); use impl='native' there")
    return mod


class Rotation:
    """Rotates (q, k) of one layout by one (cos, sin); ``call`` is the chosen implementation's call ("upstream",
    "triton", "composite" or "native"), bound in the constructor. ``cacheable``: cos/sin need no gradient,
    so what the constructor derived from them may serve every layer of the step. ``name``: the family, for
    messages."""

    def __init__(self, q, k, cos, sin, name, res, seq_dim, unsqueeze_dim, section, inplace, impl):
        from . import native as kernels

        self.kernels = kernels  # bound once: the per-layer call looks nothing up
        self.res, self.section, self.seq_dim, self.unsqueeze_dim, self.inplace = res, section, seq_dim, \
            unsqueeze_dim, inplace
        self.cos, self.sin = cos, sin
        plan = res.plan
        self.rotation = rotation = plan.rotation
        grad_trig = cos.requires_grad or sin.requires_grad
        self.cacheable = not grad_trig
        if impl == "upstream":
            self.call = self._upstream
            return
        if rotation == "deinterleave":
            # DeepSeek/MLA layout (rope_interleave): adjacent pairs in, halves out = a permutation, then NeoX
            width = cos.shape[-1]
            if width != q.shape[-1] or width != k.shape[-1]:
                raise RopeShapeError(f"apply_rope for {name}: the interleaved (MLA) rotary rotates the whole "
                                     f"head, so cos width {width} must equal q's and k's head_dim "
                                     f"({q.shape[-1]}, {k.shape[-1]}); pass the rotary part of q and k "
                                     f"(qk_rope_head_dim)")
        explicit = impl != "auto"
        if impl == "auto":
            impl = impl_for(q.device)
        if grad_trig and rotation == "deinterleave":
            # cos/sin hold cat(freqs, freqs); which half their gradient lands in is the release's formula (5.24
            # reads the first half only, earlier releases both): upstream's own function, so it lands the same
            self.call = self._upstream
            return
        if impl == "triton" and self._try_triton(name, q, k, cos, sin, explicit):
            return
        if plan.cos_rows == 3:
            cos = kernels.fold_contiguous(cos, section)
            sin = kernels.fold_contiguous(sin, section)
        if cos.dtype != q.dtype:
            cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        native = impl not in ("composite", "triton") and not (compiling() or grad_trig)
        if native and rotation == "gptj" and not (kernels.complex_viewable(q) and kernels.complex_viewable(k)):
            # pairs a complex view cannot see (an odd head_dim or slice offset, a last stride other than 1): the
            # composite computes upstream's products on any strides
            native = False
        if not native:
            # under torch.compile the plain formula is traced and fused by the compiler; with cos/sin that need
            # gradients autograd differentiates it
            self.trig = kernels.compact_trig(cos, sin, rotation, plan.gptj_cos, unsqueeze_dim)
            self.call = self._composite
            return
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        self.cos, self.sin = cos, sin
        self.trig = kernels.Trig(cos, sin, "neox" if rotation == "deinterleave" else rotation, plan.gptj_cos)
        self.call = self._pair if not inplace and rotation != "deinterleave" else self._native

    def _try_triton(self, name, q, k, cos, sin, explicit):
        if compiling():
            # traced by torch.compile: the composite, which the compiler fuses (documented); an explicit
            # impl="triton" is told so while dynamo traces (no graph break)
            if explicit:
                _say_traced(f"tfcompat apply_rope(impl='triton') for {name} under torch.compile: the compiler "
                            f"traces and fuses the composite (exact, as upstream) instead of launching the kernel; "
                            f"impl='auto' does the same without this warning")
            return False
        mod = _triton_for(name, q)
        why = "cos/sin need gradients (the kernel differentiates q and k only)" if not self.cacheable else \
            mod.unfit(q, k, cos, self.seq_dim, self.section)
        if why:
            # the composite computes what upstream does; an explicit impl="triton" is told so, once per reason
            if explicit:
                _say_once(f"tfcompat apply_rope(impl='triton') for {name}: the fused kernel cannot serve this "
                          f"call ({why}); the composite computed it (exact, as upstream)")
            return False
        layout = mod.Layout(self.rotation, self.res.plan.gptj_cos, self.section)
        # first use in this process for this (device, dtype, layout) proves the kernel against the composite (the
        # Triton row's proof)
        if not BY_NAME["triton"].proof(q, k, cos, sin, layout, self.seq_dim, self.inplace, self.rotation,
                                               self.res.plan.gptj_cos, explicit):
            return False  # failed its first-use proof under auto
        # the launch plan, made by the first layer and kept for the step's others (their q and k share this
        # rotation's shapes and strides: the carrier's key)
        self.mod, self.layout, self.plans = mod, layout, {}
        self.call = self._triton
        return True

    def __call__(self, q, k):
        return self.call(q, k)

    def _pair(self, q, k):
        return self.kernels._RopePair.apply(q, k, self.trig, self.seq_dim)

    def _triton(self, q, k):
        return self.mod.rope(q, k, self.cos, self.sin, self.layout, self.seq_dim, self.inplace, self.plans)

    def _upstream(self, q, k):
        return upstream(self.res, q, k, self.cos, self.sin, self.section, self.unsqueeze_dim)

    def _composite(self, q, k):
        kernels = self.kernels
        oq, ok = kernels.compact_one(q, self.trig, self.rotation), kernels.compact_one(k, self.trig, self.rotation)
        if self.inplace and self.cacheable:  # the composite's backward needs neither old q nor old k
            return q.copy_(oq), k.copy_(ok)
        return oq, ok

    def _native(self, q, k):
        kernels, inplace = self.kernels, self.inplace
        if self.rotation == "deinterleave":
            q, k = kernels.deinterleave(q, inplace), kernels.deinterleave(k, inplace)
        return (kernels.rotate(q, self.cos, self.sin, self.trig, self.seq_dim, inplace=inplace),
                kernels.rotate(k, self.cos, self.sin, self.trig, self.seq_dim, inplace=inplace))
