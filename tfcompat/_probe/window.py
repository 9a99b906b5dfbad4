"""Which decoder layers upstream runs with a sliding window, and how wide: a probed fact per layer.

Releases and families decide it differently, from the same config keys: 4.51 builds one mask with
``config.sliding_window`` for every layer (even with ``use_sliding_window=False``); 4.53+ Qwen2/Qwen3 decide
per layer from ``layer_types`` (``max_window_layers``); Qwen2-MoE kept the one-mask rule until 5.0, and
numbers its ``layer_types`` the other way round; Qwen3-MoE 5.x windows every layer; Qwen3-Next never
windows. Reading that from the source would be a guess per release. Instead the rule is run: upstream's own
text model, built tiny from the model's window settings (``use_sliding_window``, ``max_window_layers``,
``layer_types``, the layer count; a window of 2), runs one 5-token row with eager attention, and each
attention layer's weights show whether its last query saw every key. sdpa and eager build the same masks
(measured on 4.51-5.24), so this is what the model computes there. A model configured for a flash kernel
gets the window its attention module hands that kernel (``sliding_window`` on the module; 4.x: the
per-call rule of ``transformers4.sliding_window``), as upstream's flash path does.

Run once per distinct setting (cached), at patch time; never in a step. :func:`window_drift` holds a config file's
windows (as the release that saved it built them) against the layers this release windows.
"""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedTransformersError
from . import transformers4

__all__ = ["layer_windows", "window_drift"]

_PROBE_WINDOW = 2
_PROBE_TOKENS = 5
_CACHE: dict = {}
_KEYS = ("use_sliding_window", "max_window_layers", "layer_types", "num_hidden_layers")


def _flash(config) -> bool:
    impl = getattr(config, "_attn_implementation", None) or ""
    return impl not in ("eager", "sdpa", "")


def module_window(module):
    """The window an attention module hands a flash kernel: its ``sliding_window`` (4.x: the per-call rule)."""
    window = getattr(module, "sliding_window", None)
    if window is None and "sliding_window" not in vars(module):  # no attribute: a 4.x module
        window = transformers4.sliding_window(module)
    return window


def layer_windows(fam, text_cfg, attentions) -> tuple[dict, str]:
    """``({id(module): window or None}, how)`` for the attention modules of one text model."""
    window = getattr(text_cfg, "sliding_window", None)
    if not window:
        return {id(m): None for m in attentions}, "no sliding_window in the config"
    if _flash(text_cfg):
        return ({id(m): module_window(m) for m in attentions},
                f"{text_cfg._attn_implementation}: the window each attention module hands the kernel")
    windowed = probed(fam, text_cfg)
    out = {}
    for i, m in enumerate(attentions):
        index = getattr(m, "layer_idx", None)
        extra = windowed.get(index if index is not None else i)
        out[id(m)] = None if extra is None else window + extra
    layers = sorted(i for i, e in windowed.items() if e is not None)
    return out, (f"upstream's eager attention on a tiny copy with these settings windows layers {layers} of "
                 f"{len(windowed)}")


def probed(fam, text_cfg) -> dict:
    """``{layer index: None or the window's offset}`` for these window settings, as this release's eager attention
    runs them (the probe, once per distinct setting: cached)."""
    settings = tuple((k, _freeze(getattr(text_cfg, k, None))) for k in _KEYS)
    key = (fam.name, settings)
    if key not in _CACHE:
        _CACHE[key] = _probe(fam, dict(settings))
    return _CACHE[key]


def _freeze(value):
    return tuple(value) if isinstance(value, list) else value


def _probe(fam, settings) -> dict:
    """{layer index: None (sees every key) or the window's offset from config.sliding_window}."""
    import torch

    from . import resolve as _resolve
    from .tiny import tiny_config

    overrides: dict[str, Any] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in settings.items()
                                 if v is not None}
    overrides["sliding_window"] = _PROBE_WINDOW
    plan = _resolve.resolve("attention.signature", fam.name).plan
    module = _resolve.resolve("attention.signature", fam.name).target
    try:
        config = tiny_config(fam.name, **overrides)
        from .families import text_config

        tc = text_config(config)
        tc._attn_implementation = "eager"
        with torch.random.fork_rng():
            torch.manual_seed(0)
            text = getattr(module, plan.text_model)(tc).eval()
        attention_cls = getattr(module, fam.attention)
        seen: dict = {}

        def hook(mod, args, output, index):
            weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            if weights is not None:
                seen[index] = int((weights[0, :, -1, :].abs().amax(0) > 0).sum())

        handles = []
        layers = [m for m in text.modules() if isinstance(m, attention_cls)]
        for i, m in enumerate(layers):
            index = getattr(m, "layer_idx", None)
            handles.append(m.register_forward_hook(lambda mod, a, o, i=index if index is not None else i:
                                                   hook(mod, a, o, i)))
        ids = torch.arange(3, 3 + _PROBE_TOKENS).view(1, -1)
        with torch.no_grad():
            # a mask of ones: 4.53-4.57 VL text models cannot build their causal mask without one
            text(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, output_attentions=True)
        for h in handles:
            h.remove()
    except Exception as exc:  # the probe is upstream's own code: any failure means we cannot know
        raise UnsupportedTransformersError(
            f"tfcompat {fam.name}: cannot probe which layers transformers "
            f"{_resolve._version.transformers_version()} runs with a sliding window for these settings "
            f"({settings}): {type(exc).__name__}: {exc}; please report it") from None
    if len(seen) != len(layers):
        raise UnsupportedTransformersError(
            f"tfcompat {fam.name}: the sliding-window probe saw attention weights of {len(seen)} of {len(layers)} "
            f"layers; please report this release (transformers {_resolve._version.transformers_version()})")
    return {i: (None if count >= _PROBE_TOKENS else count - _PROBE_WINDOW) for i, count in seen.items()}


def _window_intent(raw, fam=None, saved=None):
    """``(window, the layers the saving release windowed)``: where the file says it unambiguously (``layer_types``
    for every layer, or ``use_sliding_window: false``), or by the saving release's one-mask rule (the family
    table's ``one_mask_before_4_53`` and ``one_mask_before_5``); None where neither tells (no window, or the meaning of
    ``max_window_layers`` alone, which families number differently)."""
    from .derived import text_part

    text = text_part(raw)

    def get(key):
        return text.get(key, raw.get(key))

    window, layers = get("sliding_window"), get("num_hidden_layers")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0 or not isinstance(layers, int):
        return None
    if fam is not None and fam.one_mask_before_4_53 and saved is not None and saved.release < (4, 53):
        every = saved.release < (4, 52) or get("use_sliding_window") is True
        return window, frozenset(range(layers)) if every else frozenset()
    if fam is not None and fam.one_mask_before_5 and saved is not None and saved.release < (5,):
        return window, frozenset(range(layers)) if get("use_sliding_window") is True else frozenset()
    types = get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        return window, frozenset(i for i, t in enumerate(types) if t == "sliding_attention")
    if get("use_sliding_window") is False:
        return window, frozenset()
    return None


def window_drift(raw, config, release, fam=None, saved=None):
    """The layers the file windows against the layers this release's model windows (its own eager attention
    on a tiny copy with these settings: ``window._probe``), where the window is shorter than the model's longest
    position (a window no shorter than every row changes nothing)."""
    from .derived import Drift, layers_named
    from .families import family, text_config

    intent = _window_intent(raw, fam, saved)
    text = text_config(config)
    longest = getattr(text, "max_position_embeddings", None)
    if intent is None or (isinstance(longest, int) and intent[0] >= longest):
        return []
    window, meant = intent
    total = int(text.num_hidden_layers)
    built = frozenset()
    if getattr(text, "sliding_window", None):
        built = frozenset(i for i, extra in probed(family(config), text).items() if extra is not None)
    if built == meant:
        return []
    return [Drift("sliding_window", f"{window} on {layers_named(meant, total)}",
                  f"{window} on {layers_named(built, total)}",
                  f"transformers {release}'s attention windows other layers than "
                  + (f"transformers {saved}, which saved the file, did" if saved is not None else
                     "the file sets (it names no saving release: read from its keys)")
                  + f" (this release's own eager attention on a tiny copy with these settings); sequences longer "
                  f"than {window} tokens would train with another attention")]
