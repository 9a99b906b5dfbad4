"""The RoPE settings a config describes on the installed release (``tfcompat.config.rope_parameters``): read
from ``rope_parameters`` (5.x) or ``rope_scaling`` and a top-level ``rope_theta`` (4.x), the defaults that live in
the modeling code (the ``rope.init`` resolution), never written back.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from .._probe import resolve as _resolve
from .._probe import transformers4
from .._probe.families import family as _family
from .._probe.families import text_config
from ..errors import ConfigError


def rope_dict(cfg, key):
    """The raw RoPE dict (a copy) and the name of the attribute it came from."""
    raw = cfg.__dict__.get("rope_parameters") if key == "rope_parameters" else None
    if raw is None and key == "rope_parameters":
        raw = getattr(cfg, "rope_parameters", None)
    if raw is None:
        raw = transformers4.rope_scaling(cfg)
        key = "rope_scaling"
    raw = dict(raw or {})
    layer_types = getattr(cfg, "layer_types", None) or ()
    if raw and set(raw) <= set(layer_types):
        # 5.x nests one dict per attention type; RoPE belongs to the full-attention layers
        nested = raw.get("full_attention")
        if not isinstance(nested, dict):
            raise ConfigError(
                f"{key} of {type(cfg).__name__} is nested per layer type ({sorted(raw)}) without a "
                f"'full_attention' entry; tfcompat reads RoPE of full-attention layers only"
            )
        raw = dict(nested)
    return raw, key



_KNOWN_KEYS = {"rope_type", "type", "rope_theta", "mrope_section", "mrope_interleaved", "partial_rotary_factor"}


class FrozenDict(dict):
    """A read-only dict that pickles, deep-copies and survives ``dataclasses.asdict`` (a MappingProxyType
    does none of these)."""

    def _read_only(self, *args, **kwargs):
        raise TypeError("RopeParameters.scaling is read-only; copy it with dict(...) to change it")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _read_only

    def __reduce__(self):
        return (type(self), (dict(self),))

    def __deepcopy__(self, memo):
        import copy

        return type(self)(copy.deepcopy(dict(self), memo))

    def __hash__(self):
        return hash(tuple(sorted(self.items(), key=repr)))


def rope_types():
    """"default" and every rope type the release's ROPE_INIT_FUNCTIONS can build (read when a config is, never
    by ``report``). Kept among the resolutions (``resolve.clear_cache`` forgets it with them), not in an
    ``lru_cache``: apply_rope(config=...) reads it inside regions torch.compile traces."""
    types = _resolve._cache.get("rope_types")
    if types is None:
        try:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        except ImportError:  # a release without the table builds the default rope only
            types = ("default",)
        else:
            types = tuple(dict.fromkeys(("default", *sorted(ROPE_INIT_FUNCTIONS))))
        _resolve._cache["rope_types"] = types
    return types


@dataclasses.dataclass(frozen=True)
class RopeParameters:
    """The RoPE settings a family's text rotary module uses.

    rotary_dim: width of q/k that is rotated (``head_dim * partial_rotary_factor``);
    mrope_section: (T, H, W) frequency counts summing to ``rotary_dim // 2``, or None;
    scaling: the remaining keys of the RoPE dict (``factor``, ``original_max_position_embeddings``, ...).
    """

    model_type: str
    rope_type: str
    rope_theta: float
    head_dim: int
    rotary_dim: int
    partial_rotary_factor: float
    mrope_section: Optional[tuple] = None
    mrope_interleaved: bool = False
    scaling: FrozenDict = dataclasses.field(default_factory=FrozenDict)


def rope_parameters(config: Any, *, model_type: Optional[str] = None) -> RopeParameters:
    """The :class:`RopeParameters` of ``config`` (top-level or text config); ``tfcompat.config.rope_parameters``."""
    if isinstance(config, dict):  # with model_type= too: the refusal that names the fix (AutoConfig.for_model)
        _family(config)
    fam = _family(model_type if model_type is not None else config)
    cfg = text_config(config)
    resolution = _resolve.resolve("rope.init", fam.name)
    if resolution.impl == "none":
        raise ConfigError(f"rope_parameters for {fam.name}: {resolution.reason} on transformers "
                          f"{resolution.transformers}; its config has no RoPE parameters")
    init = resolution.plan
    raw, key = rope_dict(cfg, init.config_key)

    what = f"rope_parameters({type(config).__name__})"
    rope_type = _rope_type(raw, key, what, resolution)
    theta = _theta(raw, cfg, key, what, init)
    head_dim = _head_dim(cfg, what, init.dim_key)
    partial = 1.0
    if init.reads_partial_rotary:
        partial = raw.get("partial_rotary_factor", None)
        if partial is None:
            partial = cfg.__dict__.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
        partial = 1.0 if partial is None else float(partial)
    rotary_dim = int(head_dim * partial)

    section = _section(fam, raw, init, rotary_dim, head_dim, partial)

    scaling = {k: v for k, v in raw.items() if k not in _KNOWN_KEYS}
    return RopeParameters(
        model_type=fam.text_family or fam.name,  # the decoder these parameters describe
        rope_type=rope_type,
        rope_theta=theta,
        head_dim=int(head_dim),
        rotary_dim=rotary_dim,
        partial_rotary_factor=partial,
        mrope_section=section,
        mrope_interleaved=fam.mrope == "interleaved",
        scaling=FrozenDict(scaling),
    )


def _rope_type(raw, key, what, resolution):
    rope_type = raw.get("rope_type", raw.get("type", "default")) or "default"
    if rope_type == "mrope":  # Qwen2-VL configs spell the default type "mrope"
        rope_type = "default"
    if rope_type not in rope_types():
        raise ConfigError(
            f"{what}: rope_type {rope_type!r} in {key}; the rotary module of "
            f"transformers {resolution.transformers} builds {list(rope_types())} and raises on it; set the "
            f"rope_type the checkpoint was trained with (a dict shared with the vision config picks up its "
            f"'axial' type: give each sub-config its own dict)"
        )
    return rope_type


def _theta(raw, cfg, key, what, init):
    theta = raw.get("rope_theta", cfg.__dict__.get("rope_theta", getattr(cfg, "rope_theta", None)))
    if theta is None:
        raise ConfigError(
            f"{what}: no rope_theta in {key} nor on the config; "
            f"transformers {_resolve._version.transformers_version()} keeps it in {init.config_key}; "
            f"pass a config built by transformers"
        )
    try:
        return float(theta)
    except (TypeError, ValueError):
        raise ConfigError(f"{what}: rope_theta {theta!r} is not a number; "
                          f"upstream's rotary module computes inv_freq from it; fix the config's rope_theta") from None


def _head_dim(cfg, what, dim_key=""):
    if dim_key and getattr(cfg, dim_key, None):  # the rotary module reads its width from this attribute
        return int(getattr(cfg, dim_key))
    head_dim = getattr(cfg, "head_dim", None)
    if not head_dim:
        missing = [k for k in ("hidden_size", "num_attention_heads") if getattr(cfg, k, None) is None]
        if missing:
            raise ConfigError(f"{what}: no head_dim and no {' / '.join(missing)}; "
                              f"upstream's rotary module reads head_dim, or hidden_size // num_attention_heads; "
                              f"pass a config built by transformers (AutoConfig.from_pretrained / for_model)")
        head_dim = cfg.hidden_size // cfg.num_attention_heads
    return head_dim


def _section(fam, raw, init, rotary_dim, head_dim, partial):
    if fam.mrope == "none":
        return None
    section = raw.get("mrope_section")
    if section is None:
        section = init.default_mrope_section
    if section is None:
        return None
    section = tuple(int(s) for s in section)
    if fam.mrope == "contiguous" and 2 * sum(section) != rotary_dim:
        raise ConfigError(
            f"{fam.name}: mrope_section {list(section)} adds up to {sum(section)}, but the rotary "
            f"width is {rotary_dim} (head_dim {head_dim} x partial_rotary_factor {partial}); "
            f"the sections must add up to {rotary_dim // 2}"
        )
    # interleaved sections (Qwen3-VL, Qwen3.5) are folded by upstream's own rotary module, which
    # slices its frequencies by them whatever they add up to (transformers' testers use [16, 8, 8]
    # with 4 frequencies): reported as given, never refused
    return section
