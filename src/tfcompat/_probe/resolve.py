"""Version-probing resolvers: one decision per capability, made once, cached, inspectable.

A capability is a dotted name plus a family, e.g. ``rope.apply:glm4v``. Each resolver
reads the installed transformers' modeling module (its file, parsed, not imported) and *probes*
it (which symbol the attention calls, what a function's body does, which methods a class has)
rather than comparing version strings: symbols vanish per model, not per major release.

Every decision is a frozen :class:`Resolution`. ``report()`` lists them; ``clear_cache()``
forgets them (for tests).
"""

import sys
import threading

from .. import version as _version
from ..errors import TfcompatError, UnsupportedTransformersError
from .families import FAMILIES
from .families import family as _family
from .plans import AttentionPlan, Resolution, RopeIndexPlan, RopeInitPlan, RopePlan  # noqa: F401 (public here)
from .resolvers import _RESOLVERS, rope_types, splits_video_frames  # noqa: F401 (public here)
from .source import _Def, _exists, _Imported, _load, _module, _read, _root, _Text  # noqa: F401 (re-exported)

__all__ = ["Resolution", "resolve", "report", "clear_cache", "installed_families"]


_lock = threading.RLock()
_cache: dict = {}


def clear_cache():
    """Forget every resolution (tests use this after changing what is importable)."""
    with _lock:
        _cache.clear()
        _version.transformers_version.cache_clear()
        _module.cache_clear()
        _root.cache_clear()
        rope_types.cache_clear()


def kinds(family):
    """The capabilities that exist for ``family`` (rope_index: the vision families tfcompat.embeds serves)."""
    fam = _family(family)
    return [k for k in _RESOLVERS if k != "rope_index" or (fam.vision and not fam.embeds_refusal)]


def resolve(kind, family):
    """The cached :class:`Resolution` of ``kind`` (e.g. ``"rope.apply"``) for ``family``."""
    fam = _family(family)
    capability = f"{kind}:{fam.name}"
    hit = _cache.get(capability)  # lock-free hot path (and traceable by torch.compile)
    if hit is not None:
        return hit
    torch = sys.modules.get("torch")
    if torch is not None and torch.compiler.is_compiling():
        raise TfcompatError(
            f"{capability} is first needed inside torch.compile, where transformers cannot be probed; "
            f"call tfcompat.rope.prepare({fam.name!r}) (or tfcompat.patch(model)) before compiling"
        )
    with _lock:
        hit = _cache.get(capability)
        if hit is not None:
            return hit
        if kind not in _RESOLVERS:
            raise TfcompatError(f"unknown capability kind {kind!r}; known: {', '.join(sorted(_RESOLVERS))}")
        # a composite that runs another family's text decoder (GLM-4.6V: GLM-4V's) is resolved in that
        # family's modeling module, under its own name
        # (rope_index belongs to the composite itself)
        decoder = FAMILIES[fam.text_family] if fam.text_family and kind != "rope_index" else fam
        result = _RESOLVERS[kind](decoder, capability)
        _cache[capability] = result
        return result


def installed_families():
    """Names of the supported families whose modeling module the installed transformers ships."""
    _version.require_supported_transformers()
    return [name for name, fam in FAMILIES.items() if _exists(fam.modeling)]


def report(families=None):
    """Resolve every capability for ``families`` (default: all installed) and return the records (the
    environment's kernel choices come first in :func:`tfcompat.report`, from ``_backends``).

    Capabilities that cannot be resolved are reported as a Resolution with impl
    ``"unsupported"`` and the error text as reason, so one gap does not hide the rest.
    """
    names = installed_families() if families is None else [_family(f).name for f in families]
    out = []
    for name in names:
        for kind in kinds(name):
            try:
                out.append(resolve(kind, name))
            except UnsupportedTransformersError as exc:
                out.append(Resolution(f"{kind}:{name}", "unsupported", "", str(exc),
                                      str(_version.transformers_version())))
    return out
