"""Which tokens of a row are image or video placeholders (``mm_token_type_ids``), and whether tfcompat.embeds
serves a family: shared by :mod:`..embeds` and :mod:`.rope_index`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._probe.families import family as _family
from ..errors import EmbedsError

if TYPE_CHECKING:
    import torch

__all__ = ["mm_token_type_ids"]


def _video_segments(input_ids, start_id, end_id):
    import torch

    starts = torch.cumsum(input_ids == start_id, dim=-1)
    ends = torch.cumsum(input_ids == end_id, dim=-1)
    return starts > ends


def _served(config_or_model, what):
    """The family of a config or model, if tfcompat.embeds serves it; else an EmbedsError saying why not."""
    fam = _family(getattr(config_or_model, "config", config_or_model))
    if fam.embeds_refusal:
        raise EmbedsError(f"{what}: tfcompat.embeds does not serve {fam.name}: {fam.embeds_refusal}")
    return fam


def mm_token_type_ids(config_or_model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """0 for text, 1 for image tokens, 2 for video tokens (GLM marks video frames with image tokens
    between its video start/end tokens), as the 5.3+ processors produce them.

    .. versionchanged:: 0.1.0 takes a config as well as a model."""
    import torch

    config = getattr(config_or_model, "config", config_or_model)
    fam = _served(config, "mm_token_type_ids")
    image_id = getattr(config, "image_token_id", None)
    video_id = getattr(config, "video_token_id", None)
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    if fam.video_frames_as_image_tokens:
        in_video = _video_segments(input_ids, config.video_start_token_id, config.video_end_token_id)
        types[(input_ids == image_id) & in_video] = 2
        types[(input_ids == image_id) & ~in_video] = 1
    else:
        types[input_ids == image_id] = 1
        if video_id is not None:
            types[input_ids == video_id] = 2
    return types
