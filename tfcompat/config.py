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

from typing import Any, Optional

from ._probe.families import text_config
from ._rope import settings as _settings
from ._rope.settings import FrozenDict, RopeParameters  # noqa: F401  (public here)

__all__ = ["RopeParameters", "drift", "rope_parameters", "text_config"]


def rope_parameters(config: Any, *, model_type: Optional[str] = None) -> RopeParameters:
    """The :class:`RopeParameters` of ``config`` (top-level or text config) on the installed release.

    >>> from tfcompat.testing import tiny_config
    >>> rp = rope_parameters(tiny_config("qwen2_5_vl"))   # a top-level or text config, on any release
    >>> rp.rope_theta, rp.mrope_section, rp.rotary_dim
    (10000.0, (4, 6, 6), 32)
    """
    return _settings.rope_parameters(config, model_type=model_type)


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
