"""Read RoPE settings from any GLM/Qwen config, on any supported transformers release.

transformers 4.x keeps ``rope_scaling`` (a dict, or None for unscaled models) and a
top-level ``rope_theta``; 5.x keeps ``rope_parameters`` with ``rope_theta`` inside and turns
``rope_scaling`` into an alias property that is never None. Vision-language configs keep
text settings under ``text_config`` (flat Qwen2-VL configs before 4.52). Some defaults live
in the modeling code, not the config (mRoPE sections, Qwen3-VL/Qwen3.5 interleaving).

Nothing here writes to a config.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from ._probe import resolve as _resolve
from ._probe.drift import rope_dict, text_config
from ._probe.families import family as _family
from .errors import ConfigError

__all__ = ["RopeParameters", "drift", "rope_parameters", "text_config"]

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
    """The :class:`RopeParameters` of ``config`` (top-level or text config) on the installed release.

    >>> from tfcompat.testing import tiny_config
    >>> rp = rope_parameters(tiny_config("qwen2_5_vl"))   # a top-level or text config, on any release
    >>> rp.rope_theta, rp.mrope_section, rp.rotary_dim
    (10000.0, (4, 6, 6), 32)
    """
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
    if rope_type not in _resolve.rope_types():
        raise ConfigError(
            f"{what}: rope_type {rope_type!r} in {key}; the rotary module of "
            f"transformers {resolution.transformers} builds {list(_resolve.rope_types())} and raises on it; set the "
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


def drift(path_or_config: Any) -> list:
    """The RoPE facts a config file (``config.json`` or a checkpoint folder, or a loaded config) sets that the
    installed transformers builds otherwise: a list of records with ``key``, ``in_file``, ``built`` and ``why``
    (``[]``: none). Read by building this release's own rotary module from the file, e.g. a Qwen2 saved by 5.x
    with ``rope_theta`` 1e6 (only under ``rope_parameters``) loaded by 4.57, which builds theta 1e4::

        for record in tfcompat.config.drift("path/to/checkpoint"):
            print(record.line())   # rope_theta: 1000000.0 -> 10000.0 (...)

    ``tfcompat check --config PATH`` prints them and exits 2.

    .. versionadded:: 0.2.0
    """
    from ._probe.drift import drift as _drift

    return _drift(path_or_config)
