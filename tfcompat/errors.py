"""The tfcompat exception family.

Every error subclasses both :class:`TfcompatError` and the builtin that callers
already catch (``ImportError`` for a missing upstream capability, ``ValueError``
for bad input), so existing ``except`` clauses keep working.

Messages say what was found, what is supported and what to do.
"""

__all__ = [
    "TfcompatError",
    "UnsupportedTransformersError",
    "RopeShapeError",
    "ConfigError",
    "PackingError",
    "UlyssesError",
    "EmbedsError",
    "ModelError",
    "PackedCacheError",
]


class TfcompatError(Exception):
    """Base class of every error raised by tfcompat."""


class UnsupportedTransformersError(TfcompatError, ImportError):
    """The installed transformers (or the model asked for) is not covered.

    The message names the installed transformers version, the supported range
    and what to do.
    """


class RopeShapeError(TfcompatError, ValueError):
    """Tensors handed to the rotary helpers do not have the layout this release uses."""


class ConfigError(TfcompatError, ValueError):
    """A model config lacks, or contradicts, a setting tfcompat needs to read."""


class PackingError(TfcompatError, ValueError):
    """Sequence boundaries or packed inputs that cannot be right (not increasing, not covering the tokens,
    padding inside a packed row, several rows).

    .. versionadded:: 0.1.0 (in :mod:`tfcompat.varlen`; re-exported there)
    """


class UlyssesError(TfcompatError, ValueError):
    """A head count, sequence split or group that sequence parallelism cannot serve."""


class EmbedsError(TfcompatError, ValueError):
    """Vision inputs that do not fit the text (token counts, grids, pixel shapes)."""


class ModelError(TfcompatError, TypeError):
    """An object where a model instance is expected (a config, a family name, a class).

    .. versionadded:: 0.1.0
    """


class PackedCacheError(PackingError, UlyssesError):
    """A packed row (or a sequence-parallel slice of one) passed with a KV cache: its sequences cannot share one.
    One class with or without a sequence group; an ``except`` for either parent catches it (raised as
    ``UlyssesError`` under a group and ``TfcompatError`` without one before).

    .. versionadded:: 0.2.0
    """
