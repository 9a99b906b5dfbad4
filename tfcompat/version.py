"""Which transformers is installed, read from package metadata (transformers is not imported).

Pre-release policy: a pre-release or dev build counts as the release it leads to,
so ``5.0.0rc0`` and ``5.0.0.dev0`` compare equal to ``5.0.0`` (release candidates
already carry the new API). Comparisons use :class:`packaging.version.Version`,
never strings.
"""

from __future__ import annotations

import functools
from typing import Optional

from packaging.version import InvalidVersion, Version

from .errors import UnsupportedTransformersError

__all__ = [
    "MIN_TRANSFORMERS",
    "TESTED_MAX_TRANSFORMERS",
    "transformers_version",
    "is_transformers_version_in_range",
    "require_supported_transformers",
]

#: Oldest transformers release tfcompat supports.
MIN_TRANSFORMERS = "4.51.3"
#: Newest release the tox matrix pins. Newer releases are resolved by probing and
#: reported as untested by ``tfcompat report``; they are not refused.
TESTED_MAX_TRANSFORMERS = "5.25.0"


def _normalize(version):
    """Parse ``version`` and drop pre/dev/post/local parts (see the module policy)."""
    try:
        parsed = Version(str(version))
    except InvalidVersion as exc:
        raise ValueError(f"not a version: {version!r} ({exc})") from None
    return Version(parsed.base_version)


@functools.lru_cache(maxsize=None)
def transformers_version() -> Version:
    """The installed transformers as a normalized :class:`~packaging.version.Version`.

    Raises :class:`~tfcompat.errors.UnsupportedTransformersError` when transformers
    is not installed.
    """
    import importlib.metadata  # lazily: it costs ~20 ms, and `import tfcompat` must stay cheap

    try:
        raw = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        raise UnsupportedTransformersError(
            f"tfcompat needs transformers>={MIN_TRANSFORMERS}, but transformers is not installed; "
            f"install it with `pip install 'transformers>={MIN_TRANSFORMERS}'`"
        ) from None
    return _normalize(raw)


def is_transformers_version_in_range(min_version: Optional[str] = None, max_version: Optional[str] = None) -> bool:
    """True if the installed transformers lies in ``[min_version, max_version]`` (both inclusive).

    Either bound may be None (open). Pre-releases count as their release:
    with ``5.0.0rc0`` installed, ``is_transformers_version_in_range("5.0.0")`` is True.
    """
    installed = transformers_version()
    if min_version is not None and installed < _normalize(min_version):
        return False
    if max_version is not None and installed > _normalize(max_version):
        return False
    return True


def require_supported_transformers(what: str = "tfcompat") -> Version:
    """Raise :class:`UnsupportedTransformersError` if the installed release is too old."""
    installed = transformers_version()
    if installed < Version(MIN_TRANSFORMERS):
        raise UnsupportedTransformersError(
            f"{what} supports transformers {MIN_TRANSFORMERS} to {TESTED_MAX_TRANSFORMERS} (newer releases "
            f"are probed), but transformers {installed} is installed; upgrade with "
            f"`pip install 'transformers>={MIN_TRANSFORMERS}'`"
        )
    return installed
