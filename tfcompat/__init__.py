"""tfcompat: GLM and Qwen vision-language training code that stays correct on every transformers release.

Importing this package is cheap and pure: it imports neither torch nor transformers and
patches nothing. Public modules: :mod:`.rope`, :mod:`.config`, :mod:`.errors`,
:mod:`.version`, :mod:`.testing`.
"""

__version__ = "0.1.0"

__all__ = ["__version__", "report", "clear_cache"]


def report(families=None):
    """Every resolver decision for the installed transformers (see :class:`Resolution`)."""
    from . import _resolve

    return _resolve.report(families)


def clear_cache():
    """Forget every cached resolution (for tests)."""
    from . import _resolve

    _resolve.clear_cache()
