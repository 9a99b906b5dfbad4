"""The embedding path of GLM/Qwen vision-language models, identical on every release.

* :func:`unpack_visual_output`: a vision tower's (or ``get_image_features``') output, in any
  of the shapes releases return, as ``(embeds, deepstack)``.
* :func:`get_input_embeds`: token embeddings with image/video features scattered in, exactly
  as the model's own forward builds them, plus Qwen3-VL's ``visual_pos_masks`` and
  ``deepstack_visual_embeds``. Without images or videos it runs the vision tower on the
  smallest valid dummy input and adds one zero-weighted scalar, so every vision parameter
  gets a (zero) gradient on every rank (DDP/FSDP stay in step) and no in-place op touches
  an autograd tensor.
* :func:`rope_index`: the model's own 3-D mRoPE position ids, wherever the release keeps
  ``get_rope_index`` and whatever it requires (``mm_token_type_ids`` from 5.3).

    >>> import torch
    >>> from tfcompat.embeds import rope_index
    >>> from tfcompat.testing import tiny_config, tiny_sequence
    >>> ids = torch.tensor([tiny_sequence("qwen2_vl", text=3, image=True)])   # 2 text, image (4 tokens), 1 text
    >>> positions, deltas = rope_index(tiny_config("qwen2_vl"), ids, image_grid_thw=torch.tensor([[1, 4, 4]]))
    >>> positions[:, 0].tolist()    # T, H, W rows: a config is enough (data-loading workers have no model)
    [[0, 1, 2, 3, 3, 3, 3, 5, 6], [0, 1, 2, 3, 3, 4, 4, 5, 6], [0, 1, 2, 3, 4, 3, 4, 5, 6]]

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

from ._probe import transformers4
from ._probe.rope_index import _rope_index_method, _splits_frames_of, rope_index  # noqa: F401 (public here)
from ._probe.tokens import _served, mm_token_type_ids
from .errors import EmbedsError, UnsupportedTransformersError

if TYPE_CHECKING:
    import torch

__all__ = ["EmbedsResult", "EmbedsError", "unpack_visual_output", "get_input_embeds", "rope_index",
           "mm_token_type_ids", "dummy_visual_inputs", "dummy_visual_zero", "has_audio_tower", "dummy_audio_zero",
           "tie_zero"]


@dataclasses.dataclass(frozen=True)
class EmbedsResult:
    """inputs_embeds: (batch, seq, hidden). visual_pos_masks: (batch, seq) bool, and
    deepstack_visual_embeds: one (num_visual_tokens, hidden) tensor per deepstack layer
    (Qwen3-VL only; None elsewhere or without vision tokens)."""

    inputs_embeds: object
    visual_pos_masks: object = None
    deepstack_visual_embeds: Optional[list] = None
    used_dummy: bool = False


def _cat(x):
    import torch

    if isinstance(x, (tuple, list)):
        return torch.cat([t for t in x], dim=0) if len(x) != 1 else x[0]
    return x


def unpack_visual_output(output: Any) -> tuple[torch.Tensor, Optional[list]]:
    """``(embeds, deepstack)`` from any vision output.

    Accepts a tensor (4.x Qwen2-VL / GLM-4V towers), the 4.x Qwen3-VL tuple
    ``(embeds, deepstack_list)``, ``BaseModelOutputWithPooling`` (merged features in
    ``pooler_output``), ``BaseModelOutputWithDeepstackFeatures``, and the per-image split tuples
    ``get_image_features`` returns. ``embeds`` is one (num_tokens, hidden) tensor; ``deepstack``
    is a list of such tensors (one per deepstack layer) or None.
    """
    import torch

    if isinstance(output, torch.Tensor):
        return output, None
    pooled = getattr(output, "pooler_output", None)
    if pooled is not None:
        deep = getattr(output, "deepstack_features", None)
        return _cat(pooled), None if deep is None else [_cat(d) for d in deep]
    legacy = transformers4.qwen3_vl_visual_output(output)
    if legacy is not None:
        return _cat(legacy[0]), [_cat(d) for d in legacy[1]]
    if isinstance(output, (tuple, list)) and output and all(isinstance(t, torch.Tensor) for t in output):
        return _cat(output), None  # per-image split tuple
    raise EmbedsError(
        f"unpack_visual_output: cannot read {type(output).__name__}; expected a tensor, a (embeds, deepstack) "
        f"tuple, per-image tuples, or a transformers output with pooler_output"
    )


# ------------------------------------------------------------------------------ locating
def _vl_model(model):
    """The module that owns ``visual`` (ForConditionalGeneration before 4.52, ``*Model`` after)."""
    inner = getattr(model, "model", None)
    if inner is not None and "visual" in getattr(inner, "_modules", {}):
        return inner
    if "visual" in getattr(model, "_modules", {}):
        return model
    raise UnsupportedTransformersError(
        f"tfcompat.embeds: {type(model).__name__} has no vision tower (looked for .visual and .model.visual); "
        f"pass a vision-language model of a supported family"
    )


def _features(owner, kind, pixels, grid):
    """Features through the model's own get_image_features / get_video_features, else its tower."""
    visual = owner.visual
    method = getattr(owner, f"get_{kind}_features", None)
    if method is not None:
        return unpack_visual_output(method(pixels, grid))
    return unpack_visual_output(visual(pixels.type(visual.dtype), grid_thw=grid))


def _masks(model, input_ids):
    types = mm_token_type_ids(model, input_ids)
    return types == 1, types == 2


def dummy_visual_inputs(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest valid (pixel_values, grid_thw) for the model's vision tower: one image of
    ``merge x merge`` patches (one merged token)."""
    import torch

    _served(model, "dummy_visual_inputs")
    owner: Any = _vl_model(model)
    config: Any = owner.config if hasattr(owner.config, "vision_config") else model.config
    vc = config.vision_config
    m = vc.spatial_merge_size
    patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    param = next(owner.visual.parameters())
    pixels = torch.zeros(m * m, patch_dim, dtype=param.dtype, device=param.device)
    grid = torch.tensor([[1, m, m]], device=param.device)
    return pixels, grid


def dummy_visual_zero(model: torch.nn.Module) -> torch.Tensor:
    """A zero-valued fp32 scalar that depends on every vision weight: the vision tower on
    :func:`dummy_visual_inputs`, every output (deepstack included) weighted by 0 before summing.

    Weighting before summing, in fp32: a half-precision sum of large finite features can overflow to inf,
    and inf * 0 is NaN.

    .. versionadded:: 0.1.0
    """
    owner = _vl_model(model)
    pixels, grid = dummy_visual_inputs(model)
    feats, deep = unpack_visual_output(owner.visual(pixels, grid_thw=grid))
    zero = (feats.float() * 0.0).sum()
    for d in deep or ():
        zero = zero + (d.float() * 0.0).sum()
    return zero


_TIE = None


def _tie_function():
    """The autograd function of :func:`tie_zero`, built once a process (``patch()`` builds it, so a region
    torch.compile traces only reads it)."""
    global _TIE
    if _TIE is None:
        _TIE = _build_tie()
    return _TIE


def _build_tie():
    import torch

    class TieZero(torch.autograd.Function):
        """``x + zero`` whose backward hands ``zero`` an exact zero gradient instead of the sum of x's
        gradient: in fp16 under a GradScaler that sum overflows to inf, and the zero weight then makes it NaN."""

        @staticmethod
        def forward(ctx, x, zero):
            ctx.zero_shape, ctx.zero_dtype = zero.shape, zero.dtype
            return x + zero.detach().to(x.dtype)

        @staticmethod
        def backward(ctx, grad):
            return grad, grad.new_zeros(ctx.zero_shape, dtype=ctx.zero_dtype)

    return TieZero


def tie_zero(x: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``x`` (values unchanged, a new tensor) tied into the graph of the zero-valued scalar ``zero`` (from
    :func:`dummy_visual_zero` / :func:`dummy_audio_zero`): the weights behind ``zero`` get exact, finite zero
    gradients in any dtype, whatever the size of x's gradient.

    .. versionadded:: 0.1.0
    """
    return _tie_function().apply(x, zero)


def has_audio_tower(model: torch.nn.Module) -> bool:
    """Whether the module owning the vision tower also owns an audio tower (omni thinkers)."""
    return getattr(_vl_model(model), "audio_tower", None) is not None


def dummy_audio_zero(model: torch.nn.Module) -> torch.Tensor:
    """A zero-valued fp32 scalar that depends on every audio weight of an omni thinker: its own
    ``get_audio_features`` on one chunk (2 * n_window mel frames) of zeros, weighted by 0.

    .. versionadded:: 0.1.0
    """
    import torch

    owner: Any = _vl_model(model)
    cfg = owner.audio_tower.config
    frames = 2 * int(cfg.n_window)
    weight = next(owner.audio_tower.parameters())
    feats = torch.zeros(1, cfg.num_mel_bins, frames, dtype=weight.dtype, device=weight.device)
    mask = torch.ones(1, frames, dtype=torch.long, device=weight.device)
    out = owner.get_audio_features(feats, feature_attention_mask=mask)
    out = getattr(out, "last_hidden_state", out)
    out = out[0] if isinstance(out, (tuple, list)) else out
    return (out.float() * 0.0).sum()


def get_input_embeds(model: torch.nn.Module, input_ids: torch.Tensor, *, pixel_values: Optional[torch.Tensor] = None,
                     image_grid_thw: Optional[torch.Tensor] = None, pixel_values_videos: Optional[torch.Tensor] = None,
                     video_grid_thw: Optional[torch.Tensor] = None) -> EmbedsResult:
    """Token embeddings with vision features merged in, as the installed model's forward builds them.

    Args:
        model: a vision-language model of a supported family (ForConditionalGeneration or ``*Model``).
        input_ids: (batch, seq) with the family's image/video placeholder tokens.
        pixel_values / image_grid_thw, pixel_values_videos / video_grid_thw: as the processor returns them.

    Returns:
        :class:`EmbedsResult`. Without pixels, the vision tower runs on :func:`dummy_visual_inputs` and
        ``inputs_embeds + 0 * (sum of every vision output)`` is returned (one extra tensor of the size of
        inputs_embeds; nothing in place).

    Raises:
        EmbedsError: placeholder token counts that differ from the feature counts, grids that do not
        match the pixels.
    """
    fam = _served(model, "get_input_embeds")
    owner = _vl_model(model)
    get_embeddings: Any = model.get_input_embeddings  # a PreTrainedModel method; nn.Module does not declare it
    embeds = get_embeddings()(input_ids)
    image_mask, video_mask = _masks(model, input_ids)
    deep_parts = {}
    for kind, pixels, grid, mask in (("image", pixel_values, image_grid_thw, image_mask),
                                     ("video", pixel_values_videos, video_grid_thw, video_mask)):
        if pixels is None:
            if int(mask.sum()):
                raise EmbedsError(f"get_input_embeds: input_ids hold {int(mask.sum())} {kind} tokens but no "
                                  f"pixel_values{'_videos' if kind == 'video' else ''} were given")
            continue
        _check_grid(kind, pixels, grid)
        feats, deep = _features(owner, kind, pixels, grid)
        n_tokens = int(mask.sum())
        if n_tokens != feats.shape[0]:
            raise EmbedsError(f"get_input_embeds: input_ids hold {n_tokens} {kind} tokens but the vision tower "
                              f"returned {feats.shape[0]} {kind} features; the text and the {kind}s do not match")
        feats = feats.to(embeds.device, embeds.dtype)
        embeds = embeds.masked_scatter(mask.unsqueeze(-1).expand_as(embeds), feats)
        if deep is not None:
            deep_parts[kind] = (mask, deep)

    if pixel_values is None and pixel_values_videos is None:
        # one zero-weighted scalar, added once, out of place: every vision weight joins the graph and
        # no in-place op touches an autograd tensor
        zero = dummy_visual_zero(model)
        return EmbedsResult(tie_zero(embeds, zero), used_dummy=True)

    if fam.deepstack and deep_parts:
        masks, deepstack = _deepstack(deep_parts)
        return EmbedsResult(embeds, visual_pos_masks=masks, deepstack_visual_embeds=deepstack)
    return EmbedsResult(embeds)


def _check_grid(kind, pixels, grid):
    """A (num, 3) integer grid whose patches are the pixels' rows, or an EmbedsError saying what to pass."""
    import torch

    if grid is None:
        raise EmbedsError(f"get_input_embeds: {kind} pixels given without {kind}_grid_thw")
    if not isinstance(grid, torch.Tensor) or grid.dim() != 2 or grid.shape[-1] != 3 or \
            grid.dtype.is_floating_point:
        found = f"a {type(grid).__name__}" if not isinstance(grid, torch.Tensor) else \
            f"a {grid.dtype} tensor of shape {tuple(grid.shape)}"
        raise EmbedsError(f"get_input_embeds: {kind}_grid_thw is {found}; the vision tower takes a "
                          f"(num_{kind}s, 3) integer tensor (T, H, W patches per {kind}), as the processor "
                          f"returns it: torch.tensor(grid)")
    patches = int(grid.prod(dim=-1).sum())
    if patches != pixels.shape[0]:
        raise EmbedsError(f"get_input_embeds: {kind}_grid_thw describes {patches} patches ({grid.tolist()}) "
                          f"but pixel_values has {pixels.shape[0]} rows; pass the grid the processor returned "
                          f"with these pixels")


def _deepstack(parts):

    if len(parts) == 1:
        (mask, deep), = parts.values()
        return mask, list(deep)
    image_mask, image_deep = parts["image"]
    video_mask, video_deep = parts["video"]
    visual = image_mask | video_mask
    image_joint, video_joint = image_mask[visual], video_mask[visual]
    joint = []
    for img, vid in zip(image_deep, video_deep):
        out = img.new_zeros(int(visual.sum()), img.shape[-1])
        out = out.index_put((image_joint.nonzero().flatten(),), img)
        out = out.index_put((video_joint.nonzero().flatten(),), vid)
        joint.append(out)
    return visual, joint


