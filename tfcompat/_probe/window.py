"""Which decoder layers upstream runs with a sliding window, and how wide: read where upstream keeps it.

From 4.53 each attention module holds the window its layer runs (``sliding_window``; absent or None: every key),
which is what the release's mask builder and its kernels read; on 4.51-4.52 (and Qwen2-MoE until 5.0) the text
model built one mask for every layer, whatever the module says: the family table's ``one_mask`` rule
(:func:`.transformers4.one_mask`). A model configured for a flash kernel gets the window its attention module hands
that kernel (4.x: the per-call rule of :func:`.transformers4.sliding_window`). tests/test_patch.py holds these
readings to upstream's own eager attention on every family and release of the matrix (which keys it saw).

:func:`.derived.window_drift` holds a config file's windows (as the release that saved it built them) against the
layers this release windows.
"""

from __future__ import annotations

from . import transformers4

__all__ = ["layer_windows", "mask_window"]


def _flash(config) -> bool:
    impl = getattr(config, "_attn_implementation", None) or ""
    return impl not in ("eager", "sdpa", "")


def module_window(module):
    """The window an attention module hands a flash kernel: its ``sliding_window`` (4.x: the per-call rule)."""
    window = getattr(module, "sliding_window", None)
    if window is None and "sliding_window" not in vars(module):  # no attribute: a 4.x module
        window = transformers4.sliding_window(module)
    return window


def _release():
    from ..version import transformers_version

    return transformers_version().release


def mask_window(fam, text_cfg, module, release) -> int | None:
    """The window upstream's eager and SDPA attention apply on ``module``'s layer (None: every earlier key)."""
    window = getattr(text_cfg, "sliding_window", None)
    if not window:
        return None
    when = transformers4.one_mask(fam, release)
    if when is not None:  # one mask for every layer
        return window if when == "set" or getattr(text_cfg, "use_sliding_window", None) is True else None
    return getattr(module, "sliding_window", None)


def layer_windows(fam, text_cfg, attentions) -> tuple[dict, str]:
    """``({id(module): window or None}, how)`` for the attention modules of one text model."""
    window = getattr(text_cfg, "sliding_window", None)
    if not window:
        return {id(m): None for m in attentions}, "no sliding_window in the config"
    if _flash(text_cfg):
        return ({id(m): module_window(m) for m in attentions},
                f"{text_cfg._attn_implementation}: the window each attention module hands the kernel")
    release = _release()
    out = {id(m): mask_window(fam, text_cfg, m, release) for m in attentions}
    when = transformers4.one_mask(fam, release)
    how = "each attention module's sliding_window, which this release's mask reads" if when is None else \
        (f"one mask for every layer (transformers {'.'.join(map(str, release))}: "
         + ("wherever sliding_window is set)" if when == "set" else "where use_sliding_window is true)"))
    return out, how
