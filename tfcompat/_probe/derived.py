"""What the release that saved a config file derived from it where another release derives otherwise from the same
keys (a change of code or of a key's name, not of the file's values): YaRN's factor, a part's rotation layout, the
expert count and the MoE layers (the windowed layers: :func:`window_drift`). Each rule is measured per
release and held by tests/test_drift.py to the saving release's own model (tools/drift_sweep.py). :mod:`.drift`
compares the file's RoPE keys and calls these."""

from __future__ import annotations

import dataclasses
from typing import Any

from . import transformers4
from .families import text_config
from .window import mask_window


@dataclasses.dataclass(frozen=True)
class Drift:
    """One fact the file sets that this release builds otherwise."""

    key: str
    in_file: Any
    built: Any
    why: str

    def line(self) -> str:
        return f"{self.key}: {self.in_file!r} -> {self.built!r} ({self.why})"


def text_part(raw):
    """A file's ``text_config`` dict ({} where it has none)."""
    text = raw.get("text_config")
    return text if isinstance(text, dict) else {}


def code_drift(raw, fam, saved, release):
    """Where the file was trained with another computation of a part than this release applies (a change of code, not
    of keys; the family table's ``code_changes``): what the file states (GLM-5's ``rope_interleave``), else what its
    saving release computed."""
    from packaging.version import Version

    if fam is None:
        return []
    text = text_part(raw)
    out = []
    for key, part, file_key, since, before, after in fam.code_changes:
        stated = text.get(file_key, raw.get(file_key)) if file_key else None
        if isinstance(stated, bool):
            then, why = (after if stated else before), f"the file sets {file_key}: {str(stated).lower()}"
        elif saved is not None:
            then = before if Version(str(saved)) < Version(since) else after
            why = f"transformers {saved}, which saved the file, computes {part} as {then}"
        else:
            continue
        now = before if Version(str(release)) < Version(since) else after
        if then != now:
            out.append(Drift(key, f"{part}: {then}", f"{part}: {now}",
                             f"{why}; transformers {release} computes them as {now} whatever the file says (the change "
                             f"came in {since}); the model would train and infer with other attention than it was "
                             f"trained with"))
    return out


def layers_named(windowed, total):
    """How a set of decoder layers reads in a drift line."""
    if not windowed:
        return "no layer"
    if len(windowed) == total:
        return f"all {total} layers"
    return f"layers {sorted(windowed)}"


#: the first release that builds YaRN from the explicit ``factor`` where the file also gives
#: ``original_max_position_embeddings`` (read from the wheels' ``_compute_yarn_parameters``: 4.51.3-4.55.4 replace
#: ``factor`` by ``max_position_embeddings / original_max_position_embeddings`` for inv_freq and the attention
#: scaling; 4.56.2, 4.57.6 and every 5.x keep the explicit factor, "Using the explicit factor")
YARN_EXPLICIT_FACTOR_SINCE = "4.56"


def _yarn_factor(rope, max_positions, release):
    """The factor ``release`` builds a YaRN rope dict with: the implicit one (max / original) before 4.56."""
    from packaging.version import Version

    factor, original = rope.get("factor"), rope.get("original_max_position_embeddings")
    if Version(str(release)) < Version(YARN_EXPLICIT_FACTOR_SINCE) and original and max_positions:
        return float(max_positions) / float(original)
    return float(factor)


def yarn_drift(raw, saved, release):
    """A YaRN file whose ``factor`` differs from ``max_position_embeddings / original_max_position_embeddings`` (the
    long-context recipe of the Qwen2.5/Qwen3 cards: factor 4, original 32,768, max unchanged): a release before
    4.56 builds inv_freq and the attention scaling from the ratio, a later one from the factor, so the model the
    saving release trained is not the model this one builds."""
    text = text_part(raw)
    rope = {}
    for key in ("rope_scaling", "rope_parameters"):
        value = text.get(key, raw.get(key))
        if isinstance(value, dict):
            rope.update({k: v for k, v in value.items() if v is not None})
    if rope.get("rope_type", rope.get("type")) != "yarn" or saved is None:
        return []
    factor, original = rope.get("factor"), rope.get("original_max_position_embeddings")
    max_positions = text.get("max_position_embeddings", raw.get("max_position_embeddings"))
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0
               for x in (factor, original, max_positions)):
        return []
    was, now = _yarn_factor(rope, max_positions, saved), _yarn_factor(rope, max_positions, release)
    if abs(was - now) <= 1e-9 * max(abs(was), 1.0):
        return []
    how = {True: f"max_position_embeddings / original_max_position_embeddings = {max_positions}/{original}",
           False: f"the explicit factor {factor:g}"}
    keep = f"set factor to {was:g}" if now == float(factor) else \
        f"set max_position_embeddings to {was * float(original):g}"
    return [Drift("rope_scaling.factor (YaRN, as built)", was, now,
                  f"transformers {saved} builds YaRN's inv_freq and attention scaling from "
                  f"{how[was != float(factor)]}, transformers {release} from {how[now != float(factor)]}: the "
                  f"model would train with other frequencies; {keep} in the file to build the saved model")]


#: where releases keep a MoE layer's expert count (Qwen3-MoE: ``num_experts`` on 4.x-5.0, ``num_local_experts`` from
#: 5.x releases that renamed it; GLM-4.5: ``n_routed_experts``); a file saved by a 5.x release is read in that order
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def _file_experts(raw, saved):
    text = text_part(raw)
    keys = EXPERT_KEYS if saved is None or saved.major >= 5 else EXPERT_KEYS[1:] + EXPERT_KEYS[:1]
    for key in keys:
        value = text.get(key, raw.get(key))
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return key, value
    return None


def built_experts(config, fam, index=None):
    """The experts decoder layer ``index`` of this release holds (default: the last, which every MoE family makes
    sparse), built from the loaded config on the meta device (shapes only); 0 for a dense layer, None where the
    release cannot build it."""
    import torch

    from . import resolve as _resolve

    text = text_config(config)
    signature = _resolve.resolve("attention.signature", fam.name)
    module = signature.target
    names = [n for n in getattr(getattr(module, signature.plan.text_model, None), "_no_split_modules", None) or ()
             if n.endswith("DecoderLayer")]
    layer_cls = getattr(module, names[0], None) if names else None
    if layer_cls is None:
        return None
    try:
        with torch.device("meta"):
            layer = layer_cls(text, int(text.num_hidden_layers) - 1 if index is None else index)
    except Exception:  # a layer this release cannot build from the file: the attention's check says so
        return None
    experts = next((m.experts for m in layer.modules() if hasattr(m, "experts")), None)
    if experts is None:
        return 0
    if isinstance(experts, torch.nn.ModuleList):
        return len(experts)
    fused = next((p for p in experts.parameters(recurse=False) if p.dim() == 3), None)
    return int(fused.shape[0]) if fused is not None else getattr(experts, "num_experts", None)


def expert_drift(raw, config, fam, saved, release):
    """A MoE file whose expert count this release reads from another key (Qwen3-MoE's ``num_local_experts``,
    written by 5.x releases, is unknown to 4.x and 5.0, which build their default 128 experts)."""
    found = _file_experts(raw, saved)
    if found is None or fam is None:
        return []
    built = built_experts(config, fam)
    if not built or built == found[1]:  # None: not built; 0: this release makes the last layer dense (below)
        return []
    by = f"transformers {saved}, which saved it" if saved is not None else "the file"
    return [Drift(found[0], found[1], built,
                  f"{by} keeps the expert count under {found[0]}; transformers {release}'s {fam.name} layers "
                  f"read another key and build {built} experts: the checkpoint's experts would not load as trained "
                  f"(load it with a release that reads {found[0]}, or set the key this one reads)")]


def moe_layers_drift(raw, config, fam, saved, release):
    """The layers a file's ``mlp_layer_types`` (a 5.x key) makes sparse against the layers this release builds with
    experts: a release that does not read the key derives them from ``first_k_dense_replace`` (a GLM-MoE-DSA file
    saved by 5.10.4 states every layer dense; 5.3.0 builds its last layer with experts)."""
    text = text_part(raw)
    types = text.get("mlp_layer_types", raw.get("mlp_layer_types"))
    layers = text.get("num_hidden_layers", raw.get("num_hidden_layers"))
    if fam is None or not isinstance(types, list) or not isinstance(layers, int) or len(types) != layers:
        return []
    meant = frozenset(i for i, t in enumerate(types) if t == "sparse")
    counts = [built_experts(config, fam, i) for i in range(layers)]
    if any(c is None for c in counts):
        return []
    built = frozenset(i for i, c in enumerate(counts) if c)
    if built == meant:
        return []
    by = f"transformers {saved}, which saved it," if saved is not None else "the file"
    then, now = layers_named(meant, layers), layers_named(built, layers)
    return [Drift("mlp_layer_types", f"experts on {then}", f"experts on {now}",
                  f"{by} built experts on {then}; transformers {release} builds them on {now} from this file: the "
                  f"checkpoint's MLP weights would not load as trained")]


def _window_intent(raw, fam=None, saved=None):
    """``(window, the layers the saving release windowed)``: where the file says it unambiguously (``layer_types``
    for every layer, or ``use_sliding_window: false``), or by the saving release's one-mask rule (the family
    table's ``one_mask``); None where neither tells (no window, or the meaning of ``max_window_layers`` alone,
    which families number differently)."""
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

    from ..version import transformers_version
    from . import resolve as _resolve
    from .families import family

    fam = family(config)
    release = transformers_version().release
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
    read as :func:`.window.mask_window` reads it), where the window is shorter than the model's longest
    position (a window no shorter than every row changes nothing)."""
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
