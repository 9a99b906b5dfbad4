"""The tiny configs the probes run (config scaling) and :mod:`tfcompat.testing` serves:
a family's installed config class built with a few layers, a head_dim of 32 and mRoPE sections that add up to
the rotary width. Read from the family table; nothing is downloaded."""

from __future__ import annotations

import copy
import importlib
from typing import Any

from . import resolve as _resolve
from . import transformers4
from .families import FAMILIES as _FAMILIES
from .families import TEXT_HIDDEN
from .families import family as _family

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
