"""Which decoder layers upstream runs with a sliding window, and how wide: read where upstream keeps it.

From 4.53 each attention module holds the window its layer runs (``sliding_window``; absent or None: every key),
which is what the release's mask builder and its kernels read; on 4.51-4.52 (and Qwen2-MoE until 5.0) the text
model built one mask for every layer, whatever the module says: the family table's ``one_mask`` rule
(:func:`.transformers4.one_mask`). A model configured for a flash kernel gets the window its attention module hands
that kernel (4.x: the per-call rule of :func:`.transformers4.sliding_window`). tests/test_patch.py holds these
readings to upstream's own eager attention on every family and release of the matrix (which keys it saw).

:func:`window_drift` holds a config file's windows (as the release that saved it built them) against the layers
this release windows.
"""

from __future__ import annotations

from . import transformers4

__all__ = ["layer_windows", "window_drift", "mask_window"]


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


def _window_intent(raw, fam=None, saved=None):
    """``(window, the layers the saving release windowed)``: where the file says it unambiguously (``layer_types``
    for every layer, or ``use_sliding_window: false``), or by the saving release's one-mask rule (the family
    table's ``one_mask``); None where neither tells (no window, or the meaning of ``max_window_layers`` alone,
    which families number differently)."""
    from .derived import text_part

    text = text_part(raw)

    def get(key):
        return text.get(key, raw.get(key))

    window, layers = get("sliding_window"), get("num_hidden_layers")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0 or not isinstance(layers, int):
        return None
    when = transformers4.one_mask(fam, saved.release) if fam is not None and saved is not None else None
    if when is not None:
        every = when == "set" or get("use_sliding_window") is True
        return window, frozenset(range(layers)) if every else frozenset()
    types = get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        return window, frozenset(i for i, t in enumerate(types) if t == "sliding_attention")
    if get("use_sliding_window") is False:
        return window, frozenset()
    return None


def _windowed(config, text):
    """The layers this release windows for ``config`` (its attention modules built on the meta device)."""
    import torch

    from . import resolve as _resolve
    from .families import family

    fam = family(config)
    release = _release()
    if transformers4.one_mask(fam, release) is not None:
        cls = None
    else:
        cls = getattr(_resolve.resolve("attention.signature", fam.name).target, fam.attention)
    out = set()
    for i in range(int(text.num_hidden_layers)):
        if cls is None:
            module = None
        else:
            with torch.device("meta"):
                module = cls(text, i)
        if mask_window(fam, text, module, release) is not None:
            out.add(i)
    return frozenset(out)


def window_drift(raw, config, release, fam=None, saved=None):
    """The layers the file windows against the layers this release's model windows (its own eager attention
    read as :func:`mask_window` reads it), where the window is shorter than the model's longest
    position (a window no shorter than every row changes nothing)."""
    from .derived import Drift, layers_named
    from .families import text_config

    intent = _window_intent(raw, fam, saved)
    text = text_config(config)
    longest = getattr(text, "max_position_embeddings", None)
    if intent is None or (isinstance(longest, int) and intent[0] >= longest):
        return []
    window, meant = intent
    total = int(text.num_hidden_layers)
    built = _windowed(config, text) if getattr(text, "sliding_window", None) else frozenset()
    if built == meant:
        return []
    return [Drift("sliding_window", f"{window} on {layers_named(meant, total)}",
                  f"{window} on {layers_named(built, total)}",
                  f"transformers {release}'s attention windows other layers than "
                  + (f"transformers {saved}, which saved the file, did" if saved is not None else
                     "the file sets (it names no saving release: read from its keys)")
                  + f" (the layers this release's mask windows); sequences longer "
                  f"than {window} tokens would train with another attention")]
