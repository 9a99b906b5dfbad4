"""The vision and audio towers as the step runs them: any release's vision output read as ``(embeds, deepstack)``,
the dummy forwards that give every tower weight a zero gradient on a text-only batch, and the tie that adds their
zero without touching the gradient's size. ``tfcompat.embeds`` re-exports them (the public face).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from .._probe import transformers4
from ..errors import EmbedsError, UnsupportedTransformersError
from .tokens import _served

if TYPE_CHECKING:
    import torch


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
