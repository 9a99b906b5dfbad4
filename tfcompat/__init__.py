"""tfcompat: GLM and Qwen vision-language training code that stays correct on every transformers release.

Importing this package is cheap and pure: it imports neither torch nor transformers and
patches nothing. Public modules: :mod:`.rope`, :mod:`.config`, :mod:`.errors`,
:mod:`.version`, :mod:`.testing`, :mod:`.packing`, :mod:`.varlen`, :mod:`.ulysses`, :mod:`.embeds`;
the record types :class:`Resolution` and :class:`PatchRecord` are importable from the package.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

__version__ = "0.1.0"

__all__ = ["__version__", "report", "clear_cache", "patch", "unpatch", "Resolution", "PatchRecord"]

# value types of the records report() and patch() return, importable without importing torch:
# ``from tfcompat import Resolution, PatchRecord`` (resolved on first access)
_LAZY = {"Resolution": "_resolve", "PatchRecord": "_patch"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def report(families: Optional[Iterable[str]] = None) -> list:
    """Every resolver decision for the installed transformers (see :class:`Resolution`)."""
    from . import _resolve

    return _resolve.report(families)


def clear_cache() -> None:
    """Forget every cached resolution (for tests)."""
    from . import _resolve

    _resolve.clear_cache()


def patch(model: Any, *, remove_padding: bool = True, ulysses_group: Any = None, dummy_visual: bool = True) -> Any:
    """Patch a model instance for packed sequences, Ulysses and the dummy visual forward
    (see :func:`tfcompat._patch.patch`)."""
    from . import _patch

    return _patch.patch(model, remove_padding=remove_padding, ulysses_group=ulysses_group, dummy_visual=dummy_visual)


def unpatch(model: Any) -> bool:
    """Restore a model patched by :func:`patch`."""
    from . import _patch

    return _patch.unpatch(model)
