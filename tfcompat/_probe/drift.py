"""Config drift: what the installed release makes of a config.json saved by another release.

The model the release that saved the file built (its ``transformers_version``) against what this release builds
from the same file: this release's own rotary module and attention, built from the loaded config and read back
(``inv_freq``, ``rope_type``, the windowed layers). A file saved by this release is the model this release builds
(no drift). For another release, the file's RoPE facts (where each release writes them: ``rope_parameters`` on 5.x,
``rope_scaling`` and a top-level ``rope_theta`` on 4.x, under ``text_config`` for VL families), read as that release
read them where releases differ (measured; the family table's ``reads_partial_rotary`` and
``one_mask``); a file that
names no release (or a development build) is read by its keys, and the record says so. tests/test_drift.py's sweep
holds this to the models themselves (tools/drift_sweep.py). Patch-time code: nothing per step imports it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

from .._rope.settings import rope_dict
from ..errors import ConfigError, TfcompatError
from . import derived as _derived
from .derived import Drift
from .derived import text_part as _text_part
from .families import text_config


def load_config(path: str) -> Any:
    """The config at ``path`` (a config.json or a checkpoint folder), loaded by ``AutoConfig.from_pretrained``
    as this release loads it (its legacy keys rewritten by the config class, nothing downloaded)."""
    from transformers import AutoConfig

    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(f"tfcompat check: {path} has no config.json; pass a checkpoint folder or a config file")
        return AutoConfig.from_pretrained(path, local_files_only=True)
    if not os.path.isfile(path):
        raise ConfigError(f"tfcompat check: no such file or folder: {path}")
    try:
        with open(path) as fh:
            json.load(fh)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"tfcompat check: {path} is not a JSON config: {exc}") from None
    folder = tempfile.mkdtemp(prefix="tfcompat-config-")
    try:
        shutil.copyfile(path, os.path.join(folder, "config.json"))
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


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
        raw = path_or_config.to_dict()
        raw.pop("transformers_version", None)  # to_dict writes this release's, not the release that saved the file
        return raw
    raise ConfigError(f"tfcompat.config.drift: pass a config.json path, a checkpoint folder or a loaded config, got "
                      f"{type(path_or_config).__name__}")


def _intent(raw):
    """The file's RoPE facts: theta, type, partial rotary factor (None where it sets none)."""
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
    section = rope.get("mrope_section")
    return {"rope_theta": theta, "rope_type": kind, "partial_rotary_factor": factor, "head_dim": get("head_dim"),
            "mrope_section": tuple(section) if isinstance(section, (list, tuple)) else None,
            "mrope_interleaved": rope.get("mrope_interleaved", get("mrope_interleaved"))}


def _built(config):
    """What this release builds from the loaded config: its rotary module's type, theta and rotary width."""

    from . import resolve as _resolve
    from .families import family

    fam = family(config)
    text = text_config(config)
    try:  # the class this release's text model builds (a family may reuse another's: glm46v, glm4v's on 5.0)
        rotary = _resolve.resolve("rope.init", fam.name).target(config=text)
    except Exception as exc:  # the release itself cannot build this file's rotary embedding
        raise TfcompatError(f"transformers {_release()} itself cannot run this config: its {fam.rotary} raised "
                            f"{type(exc).__name__}: {exc}; fix the config (or run the release it was written "
                            f"for)") from None
    inv = rotary.inv_freq.double()
    width = 2 * inv.numel()
    kind = str(getattr(rotary, "rope_type", "default"))
    theta = float(inv[1] ** (-width / 2.0)) if inv.numel() > 1 and kind == "default" else None
    head_dim = _attention_head_dim(fam, text)
    section = None
    if fam.mrope != "none":  # the sections this release's attention (or rotary module) folds by
        init = _resolve.resolve("rope.init", fam.name).plan
        section = rope_dict(text, init.config_key)[0].get("mrope_section") or init.default_mrope_section
    return {"rope_type": kind, "rope_theta": theta, "rotary_dim": width, "head_dim": head_dim,
            "mrope_section": section}


def _attention_head_dim(fam, text):
    """The head width this release's attention builds from the config: one attention module built on the meta
    device (shapes only), its ``head_dim`` or query projection per head; the config's own value where the module
    says neither."""
    import torch

    from . import resolve as _resolve

    try:
        module = _resolve.resolve("attention.signature", fam.name).target
        with torch.device("meta"):
            attention = getattr(module, fam.attention)(text, 0)
    except Exception as exc:  # the release itself cannot build this file's attention
        raise TfcompatError(f"transformers {_release()} itself cannot run this config: its {fam.attention} raised "
                            f"{type(exc).__name__}: {exc}; fix the config (or run the release it was written "
                            f"for)") from None
    width = getattr(attention, "head_dim", None)
    if not isinstance(width, int):
        proj = getattr(attention, "q_proj", None)
        width = proj.out_features // int(text.num_attention_heads) if proj is not None else None
    return width or getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def drift(path_or_config: Any) -> list:
    """The RoPE facts a config file sets that the installed transformers builds otherwise, as :class:`Drift`
    records (``[]``: none). A path (config.json or checkpoint folder) is loaded as this release loads it; a
    loaded config is read through ``to_dict()`` (keys the release ignores stay there as attributes)."""
    raw = raw_of(path_or_config)
    if isinstance(path_or_config, (str, os.PathLike)):
        config = loadable(os.fspath(path_or_config), raw)
    else:
        config = path_or_config
    return compare(raw, config)


def loadable(path, raw):
    """The config at ``path`` as this release loads it, or a :class:`ConfigError` that says why it cannot: a family
    this release does not ship (named from the file, before transformers' own "does not recognize this
    architecture"), or transformers' own refusal of the file (a key a newer release wrote, a value an older one
    checks strictly), with the release that saved the file."""
    from .families import family
    from .resolve import installed_families

    named = raw.get("model_type") if isinstance(raw, dict) else None
    if isinstance(named, str):
        try:
            fam = family(named)
        except TfcompatError:
            fam = None  # not a family tfcompat knows: transformers says what it makes of it below
        if fam is not None and fam.name not in installed_families():
            raise ConfigError(f"tfcompat.config.drift: transformers {_release()} does not ship {fam.name} (first "
                              f"shipped in transformers {fam.since}); install transformers>={fam.since} to load "
                              f"{path}")
    try:
        return load_config(path)
    except TfcompatError:
        raise
    except Exception as exc:  # transformers' own refusal (ValueError, huggingface_hub's strict dataclass errors)
        saved = raw.get("transformers_version", "an unnamed release") if isinstance(raw, dict) else "unknown"
        raise ConfigError(f"tfcompat.config.drift: transformers {_release()} cannot load {path} "
                          f"({type(exc).__name__}: {' '.join(str(exc).split())[:300]}); the file was saved by "
                          f"transformers {saved}: load it with that release (or one that accepts the file)") from None


def compare(raw: dict, config: Any) -> list:
    """:func:`drift` of a file's dict and the config this release loaded from it."""
    from .families import family

    if family(config).nope:
        return []
    fam = family(config)
    want, saved, release = _intent(raw), _saved_by(raw), _release()
    theta = want["rope_theta"]
    if saved is not None and str(saved) == release:
        # saved by this release: the model it builds from the file is the model the file was saved from; a
        # malformed value stays refused
        if isinstance(theta, str):
            return [Drift("rope_theta", theta, None, "a string in the file; a number is meant")]
        return []
    got = _built(config)
    out = []
    if want["rope_type"] not in (None, got["rope_type"]) and not (want["rope_type"] in ("mrope", "default") and
                                                                  got["rope_type"] == "default"):
        out.append(Drift("rope_type", want["rope_type"], got["rope_type"],
                         f"transformers {release}'s rotary module builds {got['rope_type']!r} from this file"))
    if isinstance(theta, str):
        out.append(Drift("rope_theta", theta, got["rope_theta"], "a string in the file; a number is meant"))
    elif theta is not None and got["rope_theta"] is not None and \
            abs(float(theta) - got["rope_theta"]) > 1e-3 * max(1.0, abs(float(theta))):
        out.append(Drift("rope_theta", float(theta), float(f"{got['rope_theta']:.6g}"),
                         f"transformers {release} does not read the key the file keeps it under (saved by "
                         f"transformers {raw.get('transformers_version', 'unknown')}); the model would train "
                         f"with theta {got['rope_theta']:g}"))
    out += _shape_drift(raw, config, want, got, release)
    if got["rope_type"] == "yarn":  # a release that builds no YaRN from the file: rope_type says so above
        out += _derived.yarn_drift(raw, saved, release)
    out += _derived.window_drift(raw, config, release, fam, saved)
    out += _derived.code_drift(raw, fam, saved, release)
    out += _derived.expert_drift(raw, config, fam, saved, release)
    out += _derived.moe_layers_drift(raw, config, fam, saved, release)
    factor, reading = _saved_partial(raw, want, fam, saved)
    if isinstance(factor, (int, float)) and not isinstance(factor, bool) and got["head_dim"]:
        meant = int(got["head_dim"] * float(factor))
        meant -= meant % 2
        if meant != got["rotary_dim"]:
            out.append(Drift("partial_rotary_factor", factor, got["rotary_dim"] / got["head_dim"],
                             f"transformers {release}'s rotary module rotates {got['rotary_dim']} of "
                             f"{got['head_dim']} channels, not {meant} ({reading})"))
    return out


def _saved_by(raw):
    """The release that saved the file (its ``transformers_version``); None where it names none, or one whose
    reading is not a release's: a development or pre-release build (Qwen3.5's published files name 4.57.0.dev0 and
    hold 5.x keys), or a 4.x version on a file with ``rope_parameters``, a key no 4.x release writes."""
    from packaging.version import InvalidVersion, Version

    value = raw.get("transformers_version")
    try:
        saved = Version(str(value)) if value else None
    except InvalidVersion:
        return None
    if saved is None or saved.is_devrelease or saved.is_prerelease:
        return None
    if saved.major < 5 and ("rope_parameters" in raw or "rope_parameters" in _text_part(raw)):
        return None
    return saved


def _saved_partial(raw, want, fam, saved):
    """``(factor, how it was read)``: the partial rotary factor the saving release built from the file."""
    text = _text_part(raw)
    if saved is None:
        return want["partial_rotary_factor"], \
            "the file names no saving release: read from its keys, rope_parameters first"
    if saved.major < 5:
        return text.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)), \
            f"transformers {saved}, which saved it, read the top-level key"
    # 5.x: the family table's reads_partial_rotary (measured on 5.0.0-5.24.0; tests/test_drift.py holds it to the
    # installed release); where it changed between 5.x releases, the keys are read
    reads = fam.reads_partial_rotary
    if fam.partial_rotary_read_before:
        from packaging.version import Version

        reads = Version(str(saved)) < Version(fam.partial_rotary_read_before)
    if reads is False:
        return 1.0, f"transformers {saved}, which saved it, rotates the whole head of {fam.name} whatever the key says"
    if reads is True:
        return want["partial_rotary_factor"], f"transformers {saved}, which saved it, read rope_parameters"
    return want["partial_rotary_factor"], f"read from the file's keys: 5.x releases read it differently for {fam.name}"


#: keys a VL config nests under ``text_config`` that decide RoPE and attention (a flat release reads the top level)
_NESTED = ("rope_theta", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers",
           "sliding_window", "use_sliding_window", "max_window_layers")


def _shape_drift(raw, config, want, got, release):
    """head_dim and mRoPE sections the file sets that this release builds otherwise, and a nested ``text_config``
    that a release with flat VL configs keeps as a dict while its model reads the top-level keys."""
    out = []
    head_dim = want["head_dim"]
    mla = "qk_rope_head_dim" in raw or "qk_rope_head_dim" in _text_part(raw)  # head_dim means another width there
    if isinstance(head_dim, int) and not isinstance(head_dim, bool) and head_dim != got["head_dim"] and not mla:
        out.append(Drift("head_dim", head_dim, got["head_dim"], f"transformers {release}'s attention builds heads "
                         f"of {got['head_dim']} channels (it does not read head_dim for this family); its "
                         f"projections would not match the checkpoint's"))
    section, built = want["mrope_section"], got["mrope_section"]
    if section is not None and (built is None or tuple(section) != tuple(built)):
        out.append(Drift("mrope_section", list(section), None if built is None else list(built),
                         f"transformers {release} reads the sections from a key this file does not set"
                         + (" (its attention cannot fold cos/sin without them)" if built is None else "")))
    out += _interleave_drift(config, want["mrope_interleaved"], release)
    nested = config.__dict__.get("text_config")
    if isinstance(nested, dict):
        for key in _NESTED:
            if key in nested and key in config.__dict__ and nested[key] != config.__dict__[key]:
                out.append(Drift(f"text_config.{key}", nested[key], config.__dict__[key],
                                 f"transformers {release}'s flat config keeps text_config as a dict; its model "
                                 f"reads the top-level {key}"))
    return out


def _interleave_drift(config, interleaved, release):
    """``mrope_interleaved`` set in the file against how this release's attention folds the sections (the
    rope.apply resolution, read from its source): releases fold one way per family whatever the key says."""
    from . import resolve as _resolve
    from .families import family

    fam = family(config)
    if not isinstance(interleaved, bool) or fam.mrope == "none":
        return []
    folds = _resolve.resolve("rope.apply", fam.name).plan.mrope
    if interleaved == (folds == "interleaved"):
        return []
    return [Drift("mrope_interleaved", interleaved, folds == "interleaved",
                  f"transformers {release} folds {fam.name}'s mRoPE sections {folds} whatever the file sets")]


def _release():
    from .. import version

    return str(version.transformers_version())
