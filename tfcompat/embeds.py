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

from ._step.dummy import (
    _vl_model,
    dummy_audio_zero,
    dummy_visual_inputs,
    dummy_visual_zero,
    has_audio_tower,
    tie_zero,
    unpack_visual_output,
)
from ._step.rope_index import _rope_index_method, _splits_frames_of, rope_index  # noqa: F401 (public here)
from ._step.tokens import _served, mm_token_type_ids  # noqa: F401 (public here)
from .errors import EmbedsError

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


