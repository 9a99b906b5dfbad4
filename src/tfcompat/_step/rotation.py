"""One rotation of q and k by one (cos, sin), decided and prepared once.

:class:`Rotation` chooses the implementation (by device, the kernel table's first-use proof, torch.compile,
gradients through cos/sin), folds the mRoPE sections, casts cos/sin to q's dtype and splits or signs them for
the kernel, all in its constructor; calling it rotates. ``apply_rope`` builds one per call; the patched
attention builds one per packed step and (q, k) layout and every layer calls it (:func:`for_layers`), so the
per-layer code does no choosing, folding or casting.
"""

from __future__ import annotations

import os

from .._kernels import choice as _backends  # the kernel choice (re-exported by _probe.backends)
from .._kernels.table import SAID as _SAID  # noqa: F401  (the said messages: tests clear some)
from .._kernels.table import say_once as _say_once
from .._kernels.table import say_traced as _say_traced
from .._probe.families import family as family_of
from .._probe.resolve import resolve
from ..errors import ConfigError, RopeShapeError

IMPLS = ("auto", "native", "composite", "triton", "upstream")


def chosen_impl(impl):
    """``impl`` as given, else ``TFCOMPAT_ROPE_IMPL``, else "auto"; anything else is a ConfigError."""
    chosen = impl if impl is not None else os.environ.get("TFCOMPAT_ROPE_IMPL", "auto")
    if chosen not in IMPLS:
        source = "impl=" if impl is not None else "TFCOMPAT_ROPE_IMPL="
        raise ConfigError(f"apply_rope: {source}{chosen!r} is not one of {', '.join(IMPLS)}")
    return chosen


def compiling():
    import torch

    return torch.compiler.is_compiling()


def upstream(res, q, k, cos, sin, section, unsqueeze_dim):
    """The installed transformers' own rotary function, called as its attention calls it."""
    if res.plan.cos_rows == 3:
        return res.target(q, k, cos, sin, list(section or ()), unsqueeze_dim=unsqueeze_dim)
    if res.plan.single:
        return (res.target(q, cos, sin, unsqueeze_dim=unsqueeze_dim),
                res.target(k, cos, sin, unsqueeze_dim=unsqueeze_dim))
    return res.target(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


def _triton_for(fam, q):
    mod = _backends.triton_kernels()
    if isinstance(mod, str):
        raise ConfigError(f"apply_rope for {fam.name}: impl='triton' but {mod}")
    if q.device.type != "cuda" and not (q.device.type == "cpu" and mod.interpreted()):
        raise ConfigError(f"apply_rope for {fam.name}: impl='triton' runs on CUDA tensors, q is on {q.device}; "
                          f"on CPU Triton runs only in its interpreter (TRITON_INTERPRET=1 set before triton is "
                          f"imported: slow, for tests); use impl='native' there")
    return mod


class Rotation:
    """Rotates (q, k) of one layout by one (cos, sin); ``kind`` says how: "upstream", "triton", "composite"
    or "native". ``cacheable``: cos/sin need no gradient, so what the constructor derived from them may
    serve every layer of the step."""

    def __init__(self, q, k, cos, sin, fam, res, seq_dim, unsqueeze_dim, section, inplace, impl):
        from .._kernels import rope as kernels

        self.kernels = kernels  # bound once: the per-layer call looks nothing up
        self.res, self.section, self.seq_dim, self.unsqueeze_dim, self.inplace = res, section, seq_dim, \
            unsqueeze_dim, inplace
        self.cos, self.sin = cos, sin
        plan = res.plan
        self.rotation = rotation = plan.rotation
        grad_trig = cos.requires_grad or sin.requires_grad
        self.cacheable = not grad_trig
        if impl == "upstream":
            self.kind = "upstream"
            return
        if rotation == "deinterleave":
            # DeepSeek/MLA layout (rope_interleave): adjacent pairs in, halves out = a permutation, then NeoX
            width = cos.shape[-1]
            if width != q.shape[-1] or width != k.shape[-1]:
                raise RopeShapeError(f"apply_rope for {fam.name}: the interleaved (MLA) rotary rotates the whole "
                                     f"head, so cos width {width} must equal q's and k's head_dim "
                                     f"({q.shape[-1]}, {k.shape[-1]}); pass the rotary part of q and k "
                                     f"(qk_rope_head_dim)")
        explicit = impl != "auto"
        if impl == "auto":
            impl = _backends.impl_for(q.device)
        if grad_trig and rotation == "deinterleave":
            # cos/sin hold cat(freqs, freqs); which half their gradient lands in is the release's formula (5.24
            # reads the first half only, earlier releases both): upstream's own function, so it lands the same
            self.kind = "upstream"
            return
        if impl == "triton" and self._triton(fam, q, k, cos, sin, explicit):
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
            self.kind, self.trig = "composite", kernels.compact_trig(cos, sin, rotation, plan.gptj_cos,
                                                                      unsqueeze_dim)
            return
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        self.kind, self.cos, self.sin = "native", cos, sin
        self.trig = kernels.Trig(cos, sin, "neox" if rotation == "deinterleave" else rotation, plan.gptj_cos)

    def _triton(self, fam, q, k, cos, sin, explicit):
        if compiling():
            # traced by torch.compile: the composite, which the compiler fuses (documented); an explicit
            # impl="triton" is told so while dynamo traces (no graph break)
            if explicit:
                _say_traced(f"tfcompat apply_rope(impl='triton') for {fam.name} under torch.compile: the compiler "
                            f"traces and fuses the composite (exact, as upstream) instead of launching the kernel; "
                            f"impl='auto' does the same without this warning")
            return False
        mod = _triton_for(fam, q)
        why = "cos/sin need gradients (the kernel differentiates q and k only)" if not self.cacheable else \
            mod.unfit(q, k, cos, self.seq_dim, self.section)
        if why:
            # the composite computes what upstream does; an explicit impl="triton" is told so, once per reason
            if explicit:
                _say_once(f"tfcompat apply_rope(impl='triton') for {fam.name}: the fused kernel cannot serve this "
                          f"call ({why}); the composite computed it (exact, as upstream)")
            return False
        layout = mod.Layout(self.rotation, self.res.plan.gptj_cos, self.section)
        # first use in this process for this (device, dtype, layout) proves the kernel against the composite
        from .._kernels.rope_proof import proven

        if not proven(q, k, cos, sin, layout, self.seq_dim, self.inplace, self.rotation, self.res.plan.gptj_cos,
                      explicit):
            return False  # failed its first-use proof under auto
        # the launch plan, made by the first layer and kept for the step's others (their q and k share this
        # rotation's shapes and strides: the carrier's key)
        self.kind, self.mod, self.layout, self.plans = "triton", mod, layout, {}
        return True

    def __call__(self, q, k):
        kind = self.kind
        if kind == "native" and not self.inplace and self.rotation != "deinterleave":
            return self.kernels._RopePair.apply(q, k, self.trig, self.seq_dim)
        if kind == "triton":
            return self.mod.rope(q, k, self.cos, self.sin, self.layout, self.seq_dim, self.inplace, self.plans)
        if kind == "upstream":
            return upstream(self.res, q, k, self.cos, self.sin, self.section, self.unsqueeze_dim)
        return self._other(q, k)

    def _other(self, q, k):
        kernels = self.kernels
        inplace = self.inplace
        if self.kind == "composite":
            oq, ok = kernels.compact_one(q, self.trig, self.rotation), kernels.compact_one(k, self.trig, self.rotation)
            if inplace and self.cacheable:  # the composite's backward needs neither old q nor old k
                return q.copy_(oq), k.copy_(ok)
            return oq, ok
        if self.rotation == "deinterleave":
            q, k = kernels.deinterleave(q, inplace), kernels.deinterleave(k, inplace)
        return (kernels.rotate(q, self.cos, self.sin, self.trig, self.seq_dim, inplace=inplace),
                kernels.rotate(k, self.cos, self.sin, self.trig, self.seq_dim, inplace=inplace))




def for_layers(carried, q, k, family, section, res):
    """The rotation of this step's (cos, sin) for q and k of this layout, made by the first layer that asks and
    kept on the step's carrier for the others (unless cos/sin need gradients)."""
    cos, sin = carried
    fam = family_of(family)
    rot = Rotation(q, k, cos, sin, fam, res, 2, 1, section, False, chosen_impl(None))
    if rot.cacheable:
        carried.rotations[(q.dtype, q.shape, k.shape, q.stride(), k.stride())] = rot
    return rot


def rotate(q, k, cos, sin, model_type, mrope_section, resolution=None):
    """The patched attention's rotation under torch.compile (traced: nothing kept between layers): out of place,
    (batch, heads, seq, head_dim), with the cos/sin that this release's rotary module returned (checked once
    per step, :func:`check_cos`), the sections and the ``rope.apply`` resolution bound at patch time."""
    fam = family_of(model_type)
    res = resolution if resolution is not None else resolve("rope.apply", fam.name)
    return Rotation(q, k, cos, sin, fam, res, 2, 1, mrope_section, False, chosen_impl(None))(q, k)


def check_cos(model_type, cos, sin):
    """Raise :class:`RopeShapeError` unless (cos, sin) have the layout this release's attention expects."""
    import torch

    fam = family_of(model_type)
    res = resolve("rope.apply", fam.name)
    if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)):
        raise RopeShapeError(f"tfcompat {fam.name}: the rotary module returned {type(cos).__name__}, "
                             f"{type(sin).__name__}; expected two tensors")
    want = 4 if res.plan.cos_rows == 3 else 3
    if cos.shape != sin.shape or cos.dim() != want or cos.shape[-1] % 2:
        raise RopeShapeError(f"tfcompat {fam.name}: the rotary module returned cos {tuple(cos.shape)} and sin "
                             f"{tuple(sin.shape)}; transformers {res.transformers} attention expects "
                             f"{'(3, batch, seq, dim)' if want == 4 else '(batch, seq, dim)'} with an even dim")
