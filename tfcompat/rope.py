"""Apply rotary position embeddings exactly as the installed transformers' attention does.

    >>> import torch
    >>> from tfcompat.rope import apply_rope
    >>> from tfcompat.testing import tiny_model
    >>> model = tiny_model("qwen2")                      # random weights, nothing downloaded
    >>> q, k = torch.randn(1, 4, 5, 32), torch.randn(1, 2, 5, 32)     # (batch, heads, seq, head_dim)
    >>> cos, sin = model.model.rotary_emb(q, torch.arange(5)[None])  # what the text rotary module returns
    >>> q_rot, k_rot = apply_rope(q, k, cos, sin, config=model.config)
    >>> q_rot.shape, torch.allclose(q_rot, apply_rope(q, k, cos, sin, config=model.config, impl="upstream")[0])
    (torch.Size([1, 4, 5, 32]), True)

Shapes: q, k are (batch, heads, seq, head_dim) with ``unsqueeze_dim=1`` (or
(batch, seq, heads, head_dim) with ``unsqueeze_dim=2``); cos, sin are
(batch, seq, rotary_dim), or (3, batch, seq, rotary_dim) on releases whose attention folds
the mRoPE sections itself (Qwen2-VL/2.5-VL up to 5.16, GLM-4V/4.5V 4.x).

Conventions, per family: GPT-NeoX halves (Llama, Qwen, GLM-4.5V), GPT-J pairs (GLM, GLM-4,
GLM-4V), contiguous T/H/W mRoPE sections (Qwen2-VL, Qwen2.5-VL, GLM-4V, GLM-4.5V),
interleaved sections (Qwen3-VL, Qwen3.5: folded by the rotary module), partial rotary where
cos is narrower than head_dim. Which of them applies, and which cos layout the installed
release produces, is decided by the resolver, never by the caller.

Implementations (``impl=``; the default can be set with the environment variable ``TFCOMPAT_ROPE_IMPL``):

- ``"native"``: tfcompat's CPU-tuned kernels (in-cache slices, backward by inverse rotation);
- ``"triton"``: one fused Triton launch for q and k, forward and backward (CUDA; on CPU only in
  Triton's interpreter, for tests);
- ``"composite"``: ``x * cos + swap(x) * signed_sin``, 10-14 dispatched ops, no host sync;
- ``"upstream"``: the installed transformers' own function;
- ``"auto"`` (default): by device, :func:`impl_for`: native on CPU, triton on CUDA where triton
  imports, else composite. Under ``torch.compile``, and where cos/sin need gradients, the
  composite runs (the compiler fuses it; autograd differentiates it).

.. versionadded:: 0.1.0
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

from ._probe import resolve as _resolve
from ._probe.families import family as _family
from ._rope.implementation import IMPLS, Rotation, chosen_impl, impl_for, upstream
from .errors import ConfigError, RopeShapeError

if TYPE_CHECKING:
    import torch

__all__ = ["apply_rope", "apply_rope_", "prepare", "impl_for", "IMPLS"]

def prepare(config_or_model_type: Any) -> _resolve.Resolution:
    """Resolve everything apply_rope needs for a family now, e.g. before ``torch.compile``.

    Returns the :class:`Resolution` of ``rope.apply`` for the family.
    """
    fam = _family(config_or_model_type)
    _resolve.resolve("rope.init", fam.name)
    res = _resolve.resolve("rope.apply", fam.name)
    _ = res.target  # the upstream function, imported now: a compiled region must not import
    return res


def _section(fam, config, mrope_section, plan, cos):
    if mrope_section is not None:
        try:
            section = tuple(int(s) for s in mrope_section)
        except (TypeError, ValueError):
            raise RopeShapeError(f"apply_rope for {fam.name}: mrope_section must be integers, got "
                                 f"{mrope_section!r}") from None
    elif config is not None:
        from ._rope.settings import rope_parameters

        section = rope_parameters(config, model_type=fam.name).mrope_section
    else:
        section = None
    if section is None:
        raise RopeShapeError(
            f"apply_rope for {fam.name}: cos has shape {tuple(cos.shape)}, (3, batch, seq, dim) as the "
            f"attention of this transformers release expects, so the mRoPE sections are needed; pass config= "
            f"or mrope_section="
        )
    if not section or 2 * sum(section) != cos.shape[-1]:
        # upstream splits cos by the sections (twice): sizes that do not add up to its width cannot run there
        raise RopeShapeError(
            f"apply_rope for {fam.name}: mrope_section {list(section)} must add up to half the cos width "
            f"{cos.shape[-1]} (= {cos.shape[-1] // 2}); got a sum of {sum(section)}"
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
    if q.dim() != 4 or k.dim() != 4 or unsqueeze_dim not in (1, 2):
        _check_broadcast(fam, res, q, k, cos, sin, unsqueeze_dim)
        return None  # another call shape of upstream's function (a 3-D indexer key): upstream's own formula
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
        if width != t.shape[-1] and not _rotates_part(res):
            raise RopeShapeError(
                f"apply_rope for {fam.name}: cos width {width} but {name}'s head_dim is {t.shape[-1]}; transformers "
                f"{ver}'s rotary function for this family rotates the whole head (it raises on this call); pass "
                f"q and k of the cos width, or the cos/sin the model's own rotary module returned")
    return seq_dim


_PARTIAL: dict = {}


def _rotates_part(res):
    """Whether this release's rotary function rotates the first cos-width channels and passes the rest through
    (GLM's partial rotary) rather than rotating the whole head: asked of the function once, on tiny tensors."""
    key = (res.source, res.transformers, res.plan)
    if key not in _PARTIAL:
        import torch

        q = torch.zeros(1, 1, 2, 8)
        rows = (3,) if res.plan.cos_rows == 3 else ()
        cos = torch.zeros(*rows, 1, 2, 4)
        try:
            out = upstream(res, q, q, cos, cos, (2, 0, 0), 1)
            _PARTIAL[key] = tuple(out[0].shape) == (1, 1, 2, 8)
        except (RuntimeError, ValueError, IndexError, TypeError):
            _PARTIAL[key] = False
    return _PARTIAL[key]


def _check_broadcast(fam, res, q, k, cos, sin, unsqueeze_dim):
    """A call shape outside the kernels' 4-D layouts that upstream's function takes (Qwen4-Exp's indexer rotates
    3-D keys with 2-D cos): cos.unsqueeze(unsqueeze_dim) must broadcast to q and k without changing their
    shapes, as upstream's formula then returns tensors of q's and k's shapes."""
    import torch

    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if not t.dtype.is_floating_point or t.device != q.device:
            raise RopeShapeError(f"apply_rope for {fam.name}: {name} is {t.dtype} on {t.device}; q, k, cos and sin "
                                 f"must be floating point on q's device ({q.device})")
    rows = 1 if res.plan.cos_rows == 3 else 0  # 3-row mRoPE cos: upstream folds the first dim by the sections
    if rows and (cos.dim() < 2 or cos.shape[0] != 3):
        raise RopeShapeError(f"apply_rope for {fam.name}: cos has shape {tuple(cos.shape)} but transformers "
                             f"{res.transformers} returns 3-row cos (3, ..., dim) for this model")
    width = cos.shape[-1]
    folded = tuple(cos.shape[rows:])
    try:
        unsqueezed = torch.empty(folded, device="meta").unsqueeze(unsqueeze_dim).shape
    except (IndexError, RuntimeError):
        raise RopeShapeError(f"apply_rope for {fam.name}: unsqueeze_dim={unsqueeze_dim} does not fit cos of "
                             f"shape {tuple(cos.shape)}") from None
    for name, t in (("q", q), ("k", k)):
        rotated = tuple(t.shape[:-1]) + (width,)
        try:
            fits = torch.broadcast_shapes(rotated, unsqueezed) == torch.Size(rotated)
        except RuntimeError:
            fits = False
        if not fits or width % 2 or width > t.shape[-1]:
            raise RopeShapeError(
                f"apply_rope for {fam.name}: cos {tuple(cos.shape)} unsqueezed at {unsqueeze_dim} gives "
                f"{tuple(unsqueezed)}, which does not broadcast to {name} {tuple(t.shape)} (the rotated part "
                f"{rotated}) without changing its shape; pass q and k as (batch, heads, seq, head_dim) "
                f"(unsqueeze_dim=1) or (batch, seq, heads, head_dim) (unsqueeze_dim=2), or another shape whose "
                f"leading dims cos broadcasts to, as upstream's function reads them")


def _prepare(q, k, cos, sin, config, model_type, mrope_section, unsqueeze_dim):
    fam = _family(model_type if model_type is not None else config)
    if mrope_section is not None:
        ok = isinstance(mrope_section, (tuple, list)) and len(mrope_section) >= 1 and \
            all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in mrope_section)
        if not ok:
            raise RopeShapeError(f"apply_rope for {fam.name}: mrope_section must be non-negative integers "
                                 f"(T, H, W; upstream cycles the rows of longer lists), got {mrope_section!r}")
    res = _resolve.resolve("rope.apply", fam.name)
    if res.impl == "none":
        raise ConfigError(f"apply_rope for {fam.name}: {res.reason} on transformers {res.transformers}; its "
                          f"attention uses q and k as projected (do not call apply_rope for this family)")
    seq_dim = _check(fam, res, q, k, cos, sin, unsqueeze_dim)
    return fam, res, seq_dim


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, config: Any = None,
               model_type: Optional[str] = None, mrope_section: Optional[Sequence[int]] = None, unsqueeze_dim: int = 1,
               impl: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k as the installed transformers' attention for this model does.

    Args:
        q, k: (batch, heads, seq, head_dim), or (batch, seq, heads, head_dim) with ``unsqueeze_dim=2``;
            any other shape that upstream's function takes (cos unsqueezed at ``unsqueeze_dim`` broadcasts to
            it without changing it, e.g. Qwen4-Exp's indexer keys (n, 1, d) with cos (n, d)) runs upstream's
            own formula.
        cos, sin: exactly what the model's text rotary embedding returned on this release.
        config: the model's config (top-level or text); or give ``model_type``.
        model_type: a family name such as ``"glm4v"`` or ``"qwen2_5_vl"``.
        mrope_section: (T, H, W) sections; needed only where cos/sin are 3-row and no config is given.
        impl: "auto" (default: by device, see :func:`impl_for`), "native" (CPU-tuned kernels),
            "composite" (10-14 ops, no host sync), "triton" (one fused launch; CUDA, or CPU in Triton's
            interpreter) or "upstream" (the installed transformers' own function).

    Returns:
        ``(q_embed, k_embed)``, new tensors of q's and k's shapes and dtypes.

    Raises:
        RopeShapeError: cos/sin or q/k do not have the layout this release uses.
        UnsupportedTransformersError: unknown family, or a release tfcompat does not cover.
    """
    fam, res, seq_dim = _prepare(q, k, cos, sin, config, model_type, mrope_section, unsqueeze_dim)
    section = _section(fam, config, mrope_section, res.plan, cos) if res.plan.cos_rows == 3 else None
    chosen = chosen_impl(impl)
    if seq_dim is None:  # another call shape: upstream's own formula, or its refusal as a clear error
        try:
            return upstream(res, q, k, cos, sin, section, unsqueeze_dim)
        except (ValueError, RuntimeError, IndexError, TypeError) as exc:
            raise RopeShapeError(
                f"apply_rope for {fam.name}: transformers {res.transformers}'s own rotary function cannot take q "
                f"{tuple(q.shape)} and k {tuple(k.shape)} with cos {tuple(cos.shape)} ({type(exc).__name__}: "
                f"{exc}); pass q and k as (batch, heads, seq, head_dim)") from None
    if chosen == "upstream":
        return upstream(res, q, k, cos, sin, section, unsqueeze_dim)
    import torch

    # mixed dtypes: upstream's products promote (bf16 q with fp32 cos gives fp32), so tfcompat rotates in the
    # promoted dtype; q and k promoted to different dtypes: upstream's own formula
    if not q.dtype == k.dtype == cos.dtype == sin.dtype:
        dq = torch.promote_types(torch.promote_types(q.dtype, cos.dtype), sin.dtype)
        if dq != torch.promote_types(torch.promote_types(k.dtype, cos.dtype), sin.dtype):
            return upstream(res, q, k, cos, sin, section, unsqueeze_dim)
        q, k, cos, sin = q.to(dq), k.to(dq), cos.to(dq), sin.to(dq)
    return Rotation(q, k, cos, sin, fam.name, res, seq_dim, unsqueeze_dim, section, False, chosen)(q, k)


def apply_rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, config: Any = None,
                model_type: Optional[str] = None, mrope_section: Optional[Sequence[int]] = None,
                unsqueeze_dim: int = 1, impl: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """In-place :func:`apply_rope` for callers that own q and k (fresh projection outputs).

    q and k are overwritten and returned. Autograd-correct: the backward is the inverse
    rotation, so nothing needs the pre-rotation values (a linear projection's backward
    does not need its output). Where cos/sin require gradients, the rotation is done out
    of place and new tensors are returned.

    ``impl`` as for :func:`apply_rope`; "upstream" rotates out of place and returns new tensors
    (so ``TFCOMPAT_ROPE_IMPL=upstream`` switches a patched model to upstream's rotary too). A model patched while
    ``TFCOMPAT_ROPE_IMPL`` names native, composite or triton keeps tfcompat's bundled attention forward, which
    rotates with that kernel; otherwise, where upstream's attention calls ``ALL_ATTENTION_FUNCTIONS``, upstream's
    forward rotates with its own function.
    """
    from ._rope.native import overlaps_itself, share_elements  # torch: imported at the first call

    chosen = chosen_impl(impl)
    fam, res, seq_dim = _prepare(q, k, cos, sin, config, model_type, mrope_section, unsqueeze_dim)
    section = _section(fam, config, mrope_section, res.plan, cos) if res.plan.cos_rows == 3 else None
    if seq_dim is None:
        raise RopeShapeError(f"apply_rope_ for {fam.name}: q {tuple(q.shape)} and k {tuple(k.shape)} with "
                             f"unsqueeze_dim={unsqueeze_dim}: in place takes (batch, heads, seq, head_dim) or "
                             f"(batch, seq, heads, head_dim) (unsqueeze_dim=2); use apply_rope for other shapes")
    if q is k or share_elements(q, k):
        raise RopeShapeError(f"apply_rope_ for {fam.name}: q and k share memory, so rotating one in place would "
                             f"rotate the other twice; pass separate tensors, or use apply_rope")
    for name, t in (("q", q), ("k", k)):
        if overlaps_itself(t):
            raise RopeShapeError(f"apply_rope_ for {fam.name}: {name} {tuple(t.shape)} with strides {t.stride()} has "
                                 f"elements that share memory (an expand() or a broadcast view), so one write would "
                                 f"rotate several positions; pass a tensor it owns ({name}.contiguous() or "
                                 f"{name}.clone()), or use apply_rope, which rotates out of place")
        if t.requires_grad and t.is_leaf:
            raise RopeShapeError(f"apply_rope_ for {fam.name}: {name} is a leaf tensor that requires grad; it cannot "
                                 f"be rotated in place; use apply_rope, or pass the projection output")
    if chosen == "upstream":
        return upstream(res, q, k, cos, sin, section, unsqueeze_dim)
    return Rotation(q, k, cos, sin, fam.name, res, seq_dim, unsqueeze_dim, section, True, chosen)(q, k)
