"""Tiny random-weight configs for every supported family, valid on every release in the matrix.

``tiny_config("glm4v")`` returns the installed transformers' own config class, built with a
few layers, a head_dim of 32 and mRoPE sections that add up to the rotary width, so the
model can be instantiated on a CPU in milliseconds. Nothing is downloaded.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import importlib
from typing import Any

from ._probe.families import family as _family
from ._probe.tiny import HEAD_DIM, TINY_SECTIONS, tiny_config  # noqa: F401 (public here)

__all__ = ["tiny_config", "tiny_model", "tiny_sequence", "tiny_pixels", "padded_batch", "model_class",
           "TINY_SECTIONS", "assert_close_to_model", "MODEL_RTOL", "MODEL_ATOL"]

#: The tolerance of whole-model comparisons (logits, gradients, parameters after optimizer steps; a patched
#: packed row against upstream's padded batch, sharded ranks against one process), in fp32: the sums run in
#: another order, so the absolute part scales with the reference's largest magnitude. tfcompat's tests and
#: ``tfcompat check`` (``attention.packed``: max|diff| / max(1, max|want|) <= MODEL_RTOL) use it.
MODEL_RTOL = 1e-4
MODEL_ATOL = 3e-5

def model_class(model_type: str) -> type:
    """The installed transformers' LM class of a family (ForConditionalGeneration / ForCausalLM)."""
    fam = _family(model_type)
    module = importlib.import_module(fam.modeling)
    for name in (f"{fam.prefix}ForConditionalGeneration", f"{fam.prefix}ForCausalLM"):
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"{fam.modeling} has no ForConditionalGeneration / ForCausalLM class")


def tiny_model(model_type: str, seed: int = 0, dtype: Any = None, **overrides: Any) -> Any:
    """A tiny random-weight model of ``model_type`` (fp32, eval mode, seeded)."""
    import torch

    torch.manual_seed(seed)
    model = model_class(model_type)(tiny_config(model_type, **overrides))
    return model.to(dtype or torch.float32).eval()


def tiny_sequence(model_type: str, *, text: int = 4, image: bool = False, video: bool = False,
                  image_first: bool = False, config: Any = None) -> list[int]:
    """Token ids of one sequence with an image (4x4 patches: 4 tokens at the tiny merge size 2) and/or a
    video (2 frames of 4x4 patches: 8 tokens), laid out as the family's processor lays them out; with
    ``config``, its token ids and its vision tower's merge size (1, 2 or 4) decide the tokens per frame."""
    fam = _family(model_type)
    ids = list(range(10, 10 + text))
    cfg = tiny_config(model_type) if config is None else config
    merge = int(getattr(getattr(cfg, "vision_config", None), "spatial_merge_size", None) or 2)
    per_frame = 16 // merge ** 2
    glm = fam.video_frames_as_image_tokens

    def image_tokens():
        if glm:
            return [cfg.image_start_token_id] + [cfg.image_token_id] * per_frame + [cfg.image_end_token_id]
        return [cfg.vision_start_token_id] + [cfg.image_token_id] * per_frame + [cfg.vision_end_token_id]

    def video_tokens():
        if glm:
            return [cfg.video_start_token_id] + image_tokens() * 2 + [cfg.video_end_token_id]
        if fam.video_block_per_frame:
            return ([cfg.vision_start_token_id] + [cfg.video_token_id] * per_frame + [cfg.vision_end_token_id]) * 2
        return [cfg.vision_start_token_id] + [cfg.video_token_id] * 2 * per_frame + [cfg.vision_end_token_id]

    if image:
        ids = image_tokens() + ids if image_first else ids[:2] + image_tokens() + ids[2:]
    if video:
        ids = ids + video_tokens() + [20]
    return ids


def tiny_pixels(images: int = 0, videos: int = 0, seed: int = 0) -> dict:
    """pixel_values / grids for ``images`` images and ``videos`` videos of :func:`tiny_sequence`."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    patch_dim = 3 * 2 * 4 * 4
    if images:
        out["pixel_values"] = torch.randn(16 * images, patch_dim, generator=g)
        out["image_grid_thw"] = torch.tensor([[1, 4, 4]] * images)
    if videos:
        out["pixel_values_videos"] = torch.randn(32 * videos, patch_dim, generator=g)
        out["video_grid_thw"] = torch.tensor([[2, 4, 4]] * videos)
    return out


def padded_batch(rows: Any) -> tuple:
    """``(input_ids, attention_mask)`` of token rows, right-padded with id 0: the batch the unpatched model (the
    oracle) runs, of rows such as :func:`tiny_sequence` gives.

    .. versionadded:: 0.1.0
    """
    import torch

    length = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), length), dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.as_tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask


def assert_close_to_model(got: Any, want: Any, what: str = "") -> None:
    """``torch.testing.assert_close`` with the whole-model tolerance (:data:`MODEL_RTOL`, :data:`MODEL_ATOL`
    times ``max(1, max|want|)``); ``what`` prefixes the message."""
    import torch

    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want, rtol=MODEL_RTOL, atol=MODEL_ATOL * scale, msg=lambda m: f"{what}: {m}")
