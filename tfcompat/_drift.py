"""Config drift: what the installed release makes of a config.json saved by another release.

The file's RoPE facts (where each release writes them: ``rope_parameters`` on 5.x, ``rope_scaling`` and a top-level
``rope_theta`` on 4.x, under ``text_config`` for VL families) against what this release builds from the same file:
its own rotary module, built from the loaded config, read back (``inv_freq``, ``rope_type``), never a table of
which release reads which key. Patch-time code: nothing per step imports it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from .errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Drift:
    """One fact the file sets that this release builds otherwise."""

    key: str
    in_file: Any
    built: Any
    why: str

    def line(self) -> str:
        return f"{self.key}: {self.in_file!r} -> {self.built!r} ({self.why})"


def raw_of(path_or_config):
    if isinstance(path_or_config, (str, os.PathLike)):
        path = os.fspath(path_or_config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path) as fh:
                return json.load(fh)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"tfcompat.config.drift: cannot read {path}: {exc}") from None
    if hasattr(path_or_config, "to_dict"):
        return path_or_config.to_dict()
    raise ConfigError(f"tfcompat.config.drift: pass a config.json path, a checkpoint folder or a loaded config, got "
                      f"{type(path_or_config).__name__}")


def _text_part(raw):
    text = raw.get("text_config")
    return text if isinstance(text, dict) else {}


def _intent(raw):
    """The file's RoPE facts: theta, type, mRoPE sections, partial rotary factor (None where it sets none)."""
    text = _text_part(raw)

    def get(key):
        return text.get(key, raw.get(key))

    rope = {}
    for key in ("rope_scaling", "rope_parameters"):  # 5.x's key wins where a file has both
        value = get(key)
        if isinstance(value, dict):
            rope.update({k: v for k, v in value.items() if v is not None})
    theta = rope.get("rope_theta", get("rope_theta"))
    kind = rope.get("rope_type", rope.get("type"))
    factor = rope.get("partial_rotary_factor", get("partial_rotary_factor"))
    return {"rope_theta": theta, "rope_type": kind, "mrope_section": rope.get("mrope_section"),
            "partial_rotary_factor": factor}


def _built(config):
    """What this release builds from the loaded config: its rotary module's type, theta and rotary width."""
    import importlib

    from ._families import family
    from .config import rope_parameters, text_config

    fam = family(config)
    rotary = getattr(importlib.import_module(fam.modeling), fam.rotary)(config=text_config(config))
    inv = rotary.inv_freq.double()
    width = 2 * inv.numel()
    kind = str(getattr(rotary, "rope_type", "default"))
    theta = float(inv[1] ** (-width / 2.0)) if inv.numel() > 1 and kind == "default" else None
    rp = rope_parameters(config)
    return {"rope_type": kind, "rope_theta": theta, "rotary_dim": width, "head_dim": rp.head_dim,
            "mrope_section": list(rp.mrope_section) if rp.mrope_section else None}


def drift(path_or_config: Any) -> list:
    """The RoPE facts a config file sets that the installed transformers builds otherwise, as :class:`Drift`
    records (``[]``: none). A path (config.json or checkpoint folder) is loaded as this release loads it; a
    loaded config is read through ``to_dict()`` (keys the release ignores stay there as attributes)."""
    raw = raw_of(path_or_config)
    if isinstance(path_or_config, (str, os.PathLike)):
        from ._scale import load_config

        config = load_config(os.fspath(path_or_config))
    else:
        config = path_or_config
    return compare(raw, config)


def compare(raw: dict, config: Any) -> list:
    """:func:`drift` of a file's dict and the config this release loaded from it."""
    from ._families import family

    if family(config).nope:
        return []
    want, got = _intent(raw), _built(config)
    release = _release()
    out = []
    if want["rope_type"] not in (None, got["rope_type"]) and not (want["rope_type"] in ("mrope", "default") and
                                                                  got["rope_type"] == "default"):
        out.append(Drift("rope_type", want["rope_type"], got["rope_type"],
                         f"transformers {release}'s rotary module builds {got['rope_type']!r} from this file"))
    theta = want["rope_theta"]
    if isinstance(theta, str):
        out.append(Drift("rope_theta", theta, got["rope_theta"], "a string in the file; a number is meant"))
    elif theta is not None and got["rope_theta"] is not None and \
            abs(float(theta) - got["rope_theta"]) > 1e-3 * max(1.0, abs(float(theta))):
        out.append(Drift("rope_theta", float(theta), float(f"{got['rope_theta']:.6g}"),
                         f"transformers {release} does not read the key the file keeps it under (saved by "
                         f"transformers {raw.get('transformers_version', 'unknown')}); the model would train "
                         f"with theta {got['rope_theta']:g}"))
    factor = want["partial_rotary_factor"]
    if isinstance(factor, (int, float)) and not isinstance(factor, bool) and got["head_dim"]:
        meant = int(got["head_dim"] * float(factor))
        meant -= meant % 2
        if meant != got["rotary_dim"]:
            out.append(Drift("partial_rotary_factor", factor, got["rotary_dim"] / got["head_dim"],
                             f"transformers {release}'s rotary module rotates {got['rotary_dim']} of "
                             f"{got['head_dim']} channels, not {meant}"))
    section = want["mrope_section"]
    if section is not None and got["mrope_section"] is not None and list(section) != got["mrope_section"]:
        out.append(Drift("mrope_section", list(section), got["mrope_section"],
                         f"transformers {release} reads other sections from this file"))
    return out


def _release():
    from . import version

    return str(version.transformers_version())
