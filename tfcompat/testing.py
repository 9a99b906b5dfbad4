"""Tiny random-weight configs for every supported family, valid on every release in the matrix.

``tiny_config("glm4v")`` returns the installed transformers' own config class, built with a
few layers, a head_dim of 32 and mRoPE sections that add up to the rotary width, so the
model can be instantiated on a CPU in milliseconds. Nothing is downloaded.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import copy
import importlib
from typing import Any

from . import _resolve
from ._compat import transformers4
from ._families import FAMILIES as _FAMILIES
from ._families import TEXT_HIDDEN
from ._families import family as _family

__all__ = ["tiny_config", "tiny_model", "tiny_sequence", "tiny_pixels", "padded_batch", "model_class",
           "TINY_SECTIONS", "assert_close_to_model", "MODEL_RTOL", "MODEL_ATOL"]

#: The tolerance of whole-model comparisons (logits, gradients, parameters after optimizer steps; a patched
#: packed row against upstream's padded batch, sharded ranks against one process), in fp32: the sums run in
#: another order, so the absolute part scales with the reference's largest magnitude. tfcompat's tests and
#: ``tfcompat check`` (``attention.packed``: max|diff| / max(1, max|want|) <= MODEL_RTOL) use it.
MODEL_RTOL = 1e-4
MODEL_ATOL = 3e-5

HEAD_DIM = 32

#: mRoPE sections of the tiny configs (contiguous families add up to rotary_dim/2), from the family table.
TINY_SECTIONS = {name: fam.tiny_section for name, fam in _FAMILIES.items() if fam.tiny_section}


def _text_kwargs(fam, key):
    kw = dict(
        vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=HEAD_DIM, max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=False, attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    kw.update(copy.deepcopy(fam.tiny_text))
    if fam.nope:  # no rotary: the config has no RoPE settings
        return kw
    rope = dict(fam.tiny_rope)
    if fam.tiny_section:
        rope["mrope_section"] = list(fam.tiny_section)
    theta = 10000.0
    if key == "rope_parameters":
        rope = dict(rope, rope_theta=theta)
        if fam.tiny_partial is not None:
            rope["partial_rotary_factor"] = fam.tiny_partial
        kw["rope_parameters"] = rope
    else:
        kw.update(transformers4.tiny_rope_kwargs(rope, theta, fam.tiny_partial))
    return kw


def _vision_kwargs(fam, text_hidden):
    kw = dict(depth=2, hidden_size=32, num_heads=2, in_channels=3, patch_size=4, spatial_merge_size=2,
              temporal_patch_size=2, intermediate_size=64, out_hidden_size=text_hidden)
    kw.update(_hidden(fam.tiny_vision, text_hidden))
    return kw


def _hidden(value, text_hidden):
    """A copy of value with every TEXT_HIDDEN placeholder replaced by the text hidden size."""
    if isinstance(value, dict):
        return {k: _hidden(v, text_hidden) for k, v in value.items()}
    return text_hidden if value == TEXT_HIDDEN else copy.deepcopy(value)


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """A tiny config of ``model_type`` for the installed transformers.

    ``overrides`` go to the text settings (``num_hidden_layers=1``, ...); for vision-language
    families, ``vision_config={...}`` entries update the vision settings.
    """
    fam = _family(model_type)
    key = _resolve.resolve("rope.init", fam.name).plan.config_key
    module = importlib.import_module(fam.configuration)
    cls = getattr(module, fam.config_class)
    vision_over = overrides.pop("vision_config", {})
    text = _text_kwargs(fam, key)
    text.update(overrides)
    if "layer_types" in text and "layer_types" not in overrides:
        # hybrid decoders: the tiny pattern repeated over the requested number of layers
        pattern = text["layer_types"]
        text["layer_types"] = [pattern[i % len(pattern)] for i in range(text["num_hidden_layers"])]
    if not fam.vision:
        return cls(**text)
    vision = _vision_kwargs(fam, text["hidden_size"])
    vision.update(vision_over)
    ids = dict(image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253,
               image_start_token_id=252, image_end_token_id=253, video_start_token_id=254,
               video_end_token_id=255)
    if not fam.text_family and not hasattr(module, fam.text_config_class):  # no text config class: 4.x
        return transformers4.flat_vl_config(cls, vision, ids, text)
    top = {k: _hidden(v, text["hidden_size"]) for k, v in fam.tiny_top.items()}
    return cls(text_config=text, vision_config=vision, **ids, **top)


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
