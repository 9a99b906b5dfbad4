"""``tfcompat.embeds.rope_index``: a vision family's mRoPE position ids through the installed release's own
``get_rope_index`` (the resolved method, or a framework's replacement, probed), with the grids checked first."""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any, Optional

from .._probe.families import family as _family
from ..errors import EmbedsError, UnsupportedTransformersError
from . import tokens as _tokens
from .tokens import _served

if TYPE_CHECKING:
    import torch

__all__ = ["rope_index"]


def _splits_frames(fn, fam):
    """Whether this get_rope_index splits video grids per frame itself: the release's decision (``report``
    lists it as ``rope_index``), or, for a get_rope_index a framework put in its place, its own source."""
    from .._probe import resolve as _resolve

    res = _resolve.resolve("rope_index", fam.name)
    function = getattr(fn, "__func__", fn)
    if function is getattr(res.target, "get_rope_index", None):
        return res.plan.splits_frames
    return _splits_frames_of(function)


@functools.lru_cache(maxsize=None)
def _splits_frames_of(function):
    from .._probe.resolve import _probe, splits_video_frames
    from .._probe.source import _Imported

    found = _Imported.definition(getattr(function, "__qualname__", "get_rope_index"), function)
    return _probe("rope_index", "whether get_rope_index splits video grids per frame", found, splits_video_frames)


def _rope_index_method(config_or_model):
    """``get_rope_index`` bound to the model, or, given a config, to a weightless shell of the class that
    defines it (nothing is built: no vision tower, no weights), for data-loading workers."""
    import torch

    _served(config_or_model, "rope_index")
    if isinstance(config_or_model, torch.nn.Module):
        model = config_or_model
        owner = getattr(model, "model", None)
        fn = getattr(owner, "get_rope_index", None) if owner is not None else None
        if fn is None:
            fn = getattr(model, "get_rope_index", None)
        if fn is None:
            raise UnsupportedTransformersError(f"rope_index: {type(model).__name__} has no get_rope_index (looked "
                                               f"on .model and the model itself)")
        return fn, model.config
    config = config_or_model
    fam = _family(config)
    if not fam.vision:
        raise EmbedsError(f"rope_index: {fam.name} is a text family; its position ids are 0, 1, 2, ... per sequence")
    from .._probe import resolve as _resolve

    cls = _resolve.resolve("rope_index", fam.name).target
    shell = cls.__new__(cls)
    torch.nn.Module.__init__(shell)
    shell.config = config
    shell.rope_deltas = None
    vision = getattr(config, "vision_config", None)
    if vision is not None and hasattr(vision, "spatial_merge_size"):
        shell.spatial_merge_size = vision.spatial_merge_size  # omni thinkers read it from self
    return cls.get_rope_index.__get__(shell), config


def _check_grids(config, input_ids, types, image_grid_thw, video_grid_thw, attention_mask):
    import torch

    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
        raise EmbedsError(f"rope_index: input_ids must be an integer (batch, seq) tensor, got "
                          f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
    if types.shape != input_ids.shape:
        raise EmbedsError(f"rope_index: mm_token_type_ids {tuple(types.shape)} must have input_ids' shape "
                          f"{tuple(input_ids.shape)}")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise EmbedsError(f"rope_index: attention_mask {tuple(attention_mask.shape)} must have input_ids' shape "
                          f"{tuple(input_ids.shape)}")
    vc = getattr(config, "vision_config", None)
    merge = getattr(vc, "spatial_merge_size", 2) if vc is not None else 2
    real = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    for kind, code, grid in (("image", 1, image_grid_thw), ("video", 2, video_grid_thw)):
        tokens = int(((types == code) & real).sum())
        if grid is None:
            if tokens:
                raise EmbedsError(f"rope_index: input_ids hold {tokens} {kind} tokens but no {kind}_grid_thw was "
                                  f"given; pass the grid the processor returned")
            continue
        if not isinstance(grid, torch.Tensor) or grid.dim() != 2 or grid.shape[-1] != 3 or \
                grid.dtype.is_floating_point or bool((grid <= 0).any()):
            raise EmbedsError(f"rope_index: {kind}_grid_thw must be a positive integer (n, 3) tensor of (t, h, w), got "
                              f"{getattr(grid, 'shape', type(grid).__name__)}")
        if bool(((grid[:, 1:] % merge) != 0).any()):
            raise EmbedsError(f"rope_index: {kind}_grid_thw {grid.tolist()} has h or w not divisible by the spatial "
                              f"merge size {merge}")
        want = int(grid.prod(dim=-1).sum()) // (merge * merge)
        if tokens != want:
            raise EmbedsError(f"rope_index: input_ids hold {tokens} {kind} tokens but {kind}_grid_thw {grid.tolist()} "
                              f"describes {want} (t * h * w / {merge}^2 each); the text and the grids do not match")


def rope_index(config_or_model: Any, input_ids: torch.Tensor, *, image_grid_thw: Optional[torch.Tensor] = None,
               video_grid_thw: Optional[torch.Tensor] = None, second_per_grid_ts: Optional[torch.Tensor] = None,
               attention_mask: Optional[torch.Tensor] = None, mm_token_type_ids: Optional[torch.Tensor] = None,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(position_ids (3, batch, seq), rope_deltas (batch, 1))`` exactly as the installed model's own
    ``get_rope_index`` computes them.

    Args:
        config_or_model: a vision-language model, or just its config (a data-loading worker holds no
            model: nothing is built, no weights, no vision tower).
        input_ids: (batch, seq) with the family's image/video placeholder tokens.
        image_grid_thw, video_grid_thw: (n, 3) grids from the processor; second_per_grid_ts: Qwen2.5-VL.
        attention_mask: (batch, seq), 1 for real tokens.
        mm_token_type_ids: (batch, seq) 0 text / 1 image / 2 video; computed from input_ids when absent
            (the 5.3+ ``get_rope_index`` requires it).

    Raises:
        EmbedsError: vision tokens without a grid, grids that do not match the token counts, type ids or
            masks of another shape.

    .. versionchanged:: 0.1.0 takes a config; validates grids against the tokens.
    """
    fn, config = _rope_index_method(config_or_model)
    types = mm_token_type_ids if mm_token_type_ids is not None else _tokens.mm_token_type_ids(config, input_ids)
    _check_grids(config, input_ids, types, image_grid_thw, video_grid_thw, attention_mask)
    params = inspect.signature(fn).parameters
    if video_grid_thw is not None and _family(config).video_block_per_frame and \
            not _splits_frames(fn, _family(config)):
        # Qwen3-VL / Qwen3.5 give each video frame its own vision block; get_rope_index of 5.3.x
        # consumes one grid row per block but does not split the grid per frame (later releases
        # do it themselves): split it here, (t, h, w) -> t x (1, h, w)
        import torch

        video_grid_thw = torch.repeat_interleave(video_grid_thw, video_grid_thw[:, 0], dim=0)
        video_grid_thw = torch.cat((torch.ones_like(video_grid_thw[:, :1]), video_grid_thw[:, 1:]), dim=1)
    if attention_mask is None and "audio_seqlens" in params:
        import torch

        attention_mask = torch.ones_like(input_ids)  # omni thinkers need a mask to count text-only rows
    call = dict(image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw, attention_mask=attention_mask)
    if "second_per_grids" in params:  # omni thinkers spell it so, and have no default for videos
        if video_grid_thw is not None and second_per_grid_ts is None:
            raise EmbedsError("rope_index: this family's get_rope_index needs second_per_grid_ts with videos (the "
                              "processor's video_second_per_grid: seconds per temporal patch, one per video)")
        call["second_per_grids"] = second_per_grid_ts
    elif second_per_grid_ts is not None:
        call["second_per_grid_ts"] = second_per_grid_ts
    call.update(kwargs)
    if "mm_token_type_ids" in params:
        call["mm_token_type_ids"] = types
    call = {k: v for k, v in call.items() if k in params or any(p.kind is p.VAR_KEYWORD for p in params.values())}
    try:
        pos, deltas = fn(input_ids, **call)
    except (IndexError, StopIteration, RuntimeError, ValueError, KeyError) as exc:
        raise EmbedsError(f"rope_index: transformers' get_rope_index rejected these inputs ({type(exc).__name__}: "
                          f"{exc}); check that the grids and placeholder tokens come from the same processor call"
                          ) from exc
    if pos.is_floating_point() and bool((pos == pos.round()).all()):
        pos = pos.long()  # Qwen3-Omni computes whole-number positions in float32
    return pos, deltas
