"""Apply rotary position embeddings exactly as the installed transformers' attention does.

    >>> from tfcompat.rope import apply_rope                  # doctest: +SKIP
    >>> cos, sin = position_embeddings   # what the model's text rotary module returned
    >>> q, k = apply_rope(q, k, cos, sin, config=self.config)

Shapes: q, k are (batch, heads, seq, head_dim) with ``unsqueeze_dim=1`` (or
(batch, seq, heads, head_dim) with ``unsqueeze_dim=2``); cos, sin are
(batch, seq, rotary_dim), or (3, batch, seq, rotary_dim) on releases whose attention folds
the mRoPE sections itself (Qwen2-VL/2.5-VL up to 5.16, GLM-4V/4.5V 4.x).

Conventions, per family: GPT-NeoX halves (Llama, Qwen, GLM-4.5V), GPT-J pairs (GLM, GLM-4,
GLM-4V), contiguous T/H/W mRoPE sections (Qwen2-VL, Qwen2.5-VL, GLM-4V, GLM-4.5V),
interleaved sections (Qwen3-VL, Qwen3.5: folded by the rotary module), partial rotary where
cos is narrower than head_dim. Which of them applies, and which cos layout the installed
release produces, is decided by the resolver, never by the caller.

Implementations: ``impl="native"`` (tfcompat's kernels: fewer memory passes, backward by
inverse rotation), ``"upstream"`` (the installed transformers' own function),
``"auto"`` (native; the default). The default can be set with the environment variable
``TFCOMPAT_ROPE_IMPL``.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Optional, Sequence

from . import _resolve
from ._families import family as _family
from .errors import ConfigError, RopeShapeError

if TYPE_CHECKING:
    import torch

__all__ = ["apply_rope", "apply_rope_", "prepare", "IMPLS"]

IMPLS = ("auto", "native", "upstream")


def prepare(config_or_model_type: Any) -> _resolve.Resolution:
    """Resolve everything apply_rope needs for a family now, e.g. before ``torch.compile``.

    Returns the :class:`Resolution` of ``rope.apply`` for the family.
    """
    fam = _family(config_or_model_type)
    _resolve.resolve("rope.init", fam.name)
    return _resolve.resolve("rope.apply", fam.name)


def _impl(impl):
    chosen = impl if impl is not None else os.environ.get("TFCOMPAT_ROPE_IMPL", "auto")
    if chosen not in IMPLS:
        source = "impl=" if impl is not None else "TFCOMPAT_ROPE_IMPL="
        raise ConfigError(f"apply_rope: {source}{chosen!r} is not one of {', '.join(IMPLS)}")
    return chosen


def _section(fam, config, mrope_section, plan, cos):
    if mrope_section is not None:
        try:
            section = tuple(int(s) for s in mrope_section)
        except (TypeError, ValueError):
            raise RopeShapeError(f"apply_rope for {fam.name}: mrope_section must be 3 integers, got "
                                 f"{mrope_section!r}") from None
    elif config is not None:
        from .config import rope_parameters

        section = rope_parameters(config, model_type=fam.name).mrope_section
    else:
        section = None
    if section is None:
        raise RopeShapeError(
            f"apply_rope for {fam.name}: cos has shape {tuple(cos.shape)}, (3, batch, seq, dim) as the "
            f"attention of this transformers release expects, so the mRoPE sections are needed; pass config= "
            f"or mrope_section="
        )
    if len(section) != 3 or 2 * sum(section) != cos.shape[-1]:
        raise RopeShapeError(
            f"apply_rope for {fam.name}: mrope_section {list(section)} must be 3 sections adding up to half "
            f"the cos width {cos.shape[-1]} (= {cos.shape[-1] // 2}); got a sum of {sum(section)}"
        )
    return section


def _check(fam, res, q, k, cos, sin, unsqueeze_dim):
    plan = res.plan
    ver = res.transformers
    import torch

    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise RopeShapeError(f"apply_rope for {fam.name}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if cos.shape != sin.shape:
        raise RopeShapeError(f"apply_rope for {fam.name}: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ")
    if q.dim() != 4 or k.dim() != 4:
        raise RopeShapeError(
            f"apply_rope for {fam.name}: q {tuple(q.shape)} and k {tuple(k.shape)} must be 4-D "
            f"(batch, heads, seq, head_dim) or (batch, seq, heads, head_dim) with unsqueeze_dim=2"
        )
    if unsqueeze_dim not in (1, 2):
        raise RopeShapeError(f"apply_rope: unsqueeze_dim must be 1 or 2, got {unsqueeze_dim}")
    want = 4 if plan.cos_rows == 3 else 3
    if cos.dim() != want or (want == 4 and cos.shape[0] != 3):
        expected = "(3, batch, seq, dim)" if want == 4 else "(batch, seq, dim)"
        hint = ("unfolded 3-row cos/sin" if want == 4 else "cos/sin already folded by the rotary module")
        raise RopeShapeError(
            f"apply_rope for {fam.name}: cos has shape {tuple(cos.shape)} but transformers {ver} returns "
            f"{expected} for this model ({hint}); pass the cos/sin that the model's own text rotary "
            f"embedding returned on this release"
        )
    seq_dim = 2 if unsqueeze_dim == 1 else 1
    batch, seq, width = cos.shape[-3], cos.shape[-2], cos.shape[-1]
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if not t.dtype.is_floating_point:
            raise RopeShapeError(f"apply_rope for {fam.name}: {name} has dtype {t.dtype}; q, k, cos and sin must be "
                                 f"floating point (cast integer tensors before rotating them)")
        if t.device != q.device:
            raise RopeShapeError(f"apply_rope for {fam.name}: {name} is on {t.device} but q is on {q.device}; "
                                 f"move cos/sin to q's device")
    for name, t in (("q", q), ("k", k)):
        if t.shape[seq_dim] != seq or (batch != 1 and t.shape[0] != batch):
            raise RopeShapeError(
                f"apply_rope for {fam.name}: {name} has shape {tuple(t.shape)} but cos has batch {batch} and "
                f"seq {seq}; with unsqueeze_dim={unsqueeze_dim}, {name} must be "
                f"{'(batch, heads, seq, head_dim)' if unsqueeze_dim == 1 else '(batch, seq, heads, head_dim)'} "
                f"with cos's batch (or cos of batch 1)"
            )
        if width > t.shape[-1] or width % 2:
            raise RopeShapeError(
                f"apply_rope for {fam.name}: cos width {width} must be even and at most {name}'s head_dim "
                f"{t.shape[-1]}"
            )
    return seq_dim


def _prepare(q, k, cos, sin, config, model_type, mrope_section, unsqueeze_dim):
    fam = _family(model_type if model_type is not None else config)
    if mrope_section is not None:
        ok = isinstance(mrope_section, (tuple, list)) and len(mrope_section) == 3 and \
            all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in mrope_section)
        if not ok:
            raise RopeShapeError(f"apply_rope for {fam.name}: mrope_section must be 3 non-negative integers "
                                 f"(T, H, W), got {mrope_section!r}")
    res = _resolve.resolve("rope.apply", fam.name)
    seq_dim = _check(fam, res, q, k, cos, sin, unsqueeze_dim)
    return fam, res, seq_dim


def _compiling():
    import torch

    return torch.compiler.is_compiling()


def _native(q, k, cos, sin, fam, res, seq_dim, unsqueeze_dim, section, inplace):
    from ._kernels import rope as kernels

    plan = res.plan
    rotation = plan.rotation
    if rotation == "deinterleave":
        # DeepSeek/MLA layout (rope_interleave): adjacent pairs in, halves out = a permutation, then NeoX
        width = cos.shape[-1]
        if width != q.shape[-1] or width != k.shape[-1]:
            raise RopeShapeError(f"apply_rope for {fam.name}: the interleaved (MLA) rotary rotates the whole head, "
                                 f"so cos width {width} must equal q's and k's head_dim "
                                 f"({q.shape[-1]}, {k.shape[-1]}); "
                                 f"pass the rotary part of q and k (qk_rope_head_dim)")
        q, k = kernels.deinterleave(q, inplace), kernels.deinterleave(k, inplace)
        rotation = "neox"
    if plan.cos_rows == 3:
        cos = kernels.fold_contiguous(cos, section)
        sin = kernels.fold_contiguous(sin, section)
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    if cos.dtype != q.dtype:
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    if _compiling():
        # under torch.compile the plain formula is traced and fused by the compiler
        trig = kernels.Trig(cos, sin, rotation, plan.gptj_cos, probe_pairs=False)
        return kernels.composite(q, trig), kernels.composite(k, trig)
    trig = kernels.Trig(cos, sin, rotation, plan.gptj_cos)
    return (kernels.rotate(q, cos, sin, trig, seq_dim, inplace=inplace),
            kernels.rotate(k, cos, sin, trig, seq_dim, inplace=inplace))


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, config: Any = None,
               model_type: Optional[str] = None, mrope_section: Optional[Sequence[int]] = None, unsqueeze_dim: int = 1,
               impl: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k as the installed transformers' attention for this model does.

    Args:
        q, k: (batch, heads, seq, head_dim), or (batch, seq, heads, head_dim) with ``unsqueeze_dim=2``.
        cos, sin: exactly what the model's text rotary embedding returned on this release.
        config: the model's config (top-level or text); or give ``model_type``.
        model_type: a family name such as ``"glm4v"`` or ``"qwen2_5_vl"``.
        mrope_section: (T, H, W) sections; needed only where cos/sin are 3-row and no config is given.
        impl: "auto" (default), "native" or "upstream".

    Returns:
        ``(q_embed, k_embed)``, new tensors of q's and k's shapes and dtypes.

    Raises:
        RopeShapeError: cos/sin or q/k do not have the layout this release uses.
        UnsupportedTransformersError: unknown family, or a release tfcompat does not cover.
    """
    fam, res, seq_dim = _prepare(q, k, cos, sin, config, model_type, mrope_section, unsqueeze_dim)
    section = _section(fam, config, mrope_section, res.plan, cos) if res.plan.cos_rows == 3 else None
    if _impl(impl) == "upstream":
        if res.plan.cos_rows == 3:
            return res.target(q, k, cos, sin, list(section or ()), unsqueeze_dim=unsqueeze_dim)
        if res.plan.single:
            return (res.target(q, cos, sin, unsqueeze_dim=unsqueeze_dim),
                    res.target(k, cos, sin, unsqueeze_dim=unsqueeze_dim))
        return res.target(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    return _native(q, k, cos, sin, fam, res, seq_dim, unsqueeze_dim, section, inplace=False)


def apply_rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, config: Any = None,
                model_type: Optional[str] = None, mrope_section: Optional[Sequence[int]] = None,
                unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """In-place :func:`apply_rope` for callers that own q and k (fresh projection outputs).

    q and k are overwritten and returned. Autograd-correct: the backward is the inverse
    rotation, so nothing needs the pre-rotation values (a linear projection's backward
    does not need its output). Where cos/sin require gradients, the rotation is done out
    of place and new tensors are returned.
    """
    fam, res, seq_dim = _prepare(q, k, cos, sin, config, model_type, mrope_section, unsqueeze_dim)
    section = _section(fam, config, mrope_section, res.plan, cos) if res.plan.cos_rows == 3 else None
    import torch

    if q is k or (q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() and torch._C._overlaps(q, k)):
        raise RopeShapeError(f"apply_rope_ for {fam.name}: q and k share memory, so rotating one in place would "
                             f"rotate the other twice; pass separate tensors, or use apply_rope")
    for name, t in (("q", q), ("k", k)):
        if t.requires_grad and t.is_leaf:
            raise RopeShapeError(f"apply_rope_ for {fam.name}: {name} is a leaf tensor that requires grad; it cannot "
                                 f"be rotated in place; use apply_rope, or pass the projection output")
    return _native(q, k, cos, sin, fam, res, seq_dim, unsqueeze_dim, section, inplace=True)
