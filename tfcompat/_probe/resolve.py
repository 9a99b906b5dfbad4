"""Version-probing resolvers: one decision per capability, made once, cached, inspectable.

A capability is a dotted name plus a family, e.g. ``rope.apply:glm4v``. Each resolver
reads the installed transformers' modeling module (its file, parsed, not imported) and *probes*
it (which symbol the attention calls, what a function's body does, which methods a class has)
rather than comparing version strings: symbols vanish per model, not per major release.

Every decision is a frozen :class:`Resolution`. ``report()`` lists them; ``clear_cache()``
forgets them (for tests). The resolvers come first (one per capability kind, ``_RESOLVERS``), then the cache.
"""

import re
import sys
import threading

from .. import version as _version
from ..errors import TfcompatError, UnsupportedTransformersError
from . import carrier as _carrier
from . import transformers4
from .families import FAMILIES, PROBE_ONLY
from .families import family as _family
from .plans import AttentionPlan, CarrierPlan, Resolution, RopeIndexPlan, RopeInitPlan, RopePlan  # noqa: F401 (public here)
from .source import _Def, _exists, _Imported, _load, _module, _read, _root, _Text  # noqa: F401 (re-exported)

_NO_FACT = object()


def _probe(capability, what, fn, decide, declared=_NO_FACT):
    """``decide(source of fn)``; where the source cannot be read (a frozen or stripped install), the
    family's declared fact with a warning, or an error when there is none: never a silent default."""
    if fn.body:
        return decide(fn.body)
    if declared is not _NO_FACT:
        import warnings

        warnings.warn(f"tfcompat {capability}: cannot read the source of {fn.where} to probe {what}; using the "
                      f"family's declared fact ({declared!r})", RuntimeWarning, stacklevel=3)
        return declared
    raise UnsupportedTransformersError(
        f"{capability}: cannot read the source of {fn.where} (transformers {_version.transformers_version()}) to "
        f"probe {what}, and the family declares no fact for it; install transformers with its .py sources "
        f"(not a stripped or frozen build)"
    )


def _modeling(fam, capability):
    installed = _version.require_supported_transformers(capability)
    try:
        if not _exists(fam.modeling):
            raise ImportError(f"No module named {fam.modeling!r}")
        return _module(fam.modeling)
    except ImportError as exc:
        raise UnsupportedTransformersError(
            f"{capability}: transformers {installed} has no {fam.modeling} ({exc}); the {fam.name} family "
            f"first ships with transformers {fam.since}; upgrade transformers or use another family"
        ) from None


def _method(module, cls, name, capability):
    found = module.method(cls, name)
    if found is None:
        raise UnsupportedTransformersError(
            f"{capability}: transformers {_version.transformers_version()} has no {module.name}.{cls}.{name}; "
            f"tfcompat knows this family from transformers {_version.MIN_TRANSFORMERS} to "
            f"{_version.TESTED_MAX_TRANSFORMERS}; please report this release to tfcompat"
        )
    return found


def _nope(fam, capability, module, plan):
    """NoPE decoders: the declared fact, confirmed by the attention not calling a rotary function."""
    forward = _method(module, fam.attention, "forward", capability)
    rotates = _probe(capability, "whether the attention rotates q/k", forward,
                     lambda b: bool(re.search(r"apply_\w*rotary\w*\(", b)), False)
    if rotates:
        raise UnsupportedTransformersError(
            f"{capability}: the family table says {fam.name} has no rotary position embedding, but "
            f"{fam.attention}.forward of transformers {_version.transformers_version()} applies one; please report "
            f"this release to tfcompat")
    return Resolution(capability, "none", f"{module.name}.{fam.attention}.forward",
                      f"{fam.attention}.forward applies no rotary position embedding (NoPE): nothing to rotate",
                      str(_version.transformers_version()), plan)


def _resolve_rope_apply(fam, capability):
    module = _modeling(fam, capability)
    if fam.nope:
        return _nope(fam, capability, module, RopePlan(rotation="none", cos_rows=0))
    forward = _method(module, fam.attention, "forward", capability)
    body = _probe(capability, "which rotary function the attention calls", forward, lambda b: b)
    where = f"{fam.attention}.forward"
    if fam.rotation == "deinterleave" and "apply_rotary_pos_emb_interleave(" in body and \
            module.has("apply_rotary_pos_emb_interleave"):
        name, rows = "apply_rotary_pos_emb_interleave", 0
        reason = (f"{where} calls apply_rotary_pos_emb_interleave (the config's rope_interleave default): adjacent "
                  f"pairs in, halves out; cos/sin folded as (batch, seq, dim)")
    elif "apply_multimodal_rotary_pos_emb" in body and module.has("apply_multimodal_rotary_pos_emb"):
        name, rows = "apply_multimodal_rotary_pos_emb", 3
        reason = f"{where} calls apply_multimodal_rotary_pos_emb: cos/sin arrive as (3, batch, seq, dim)"
    elif "apply_rotary_pos_emb(" in body and module.has("apply_rotary_pos_emb"):
        name, rows = "apply_rotary_pos_emb", 0
        reason = f"{where} calls apply_rotary_pos_emb: cos/sin arrive folded as (batch, seq, dim)"
    else:
        raise UnsupportedTransformersError(
            f"{capability}: {where} in transformers {_version.transformers_version()} calls neither "
            f"apply_multimodal_rotary_pos_emb nor apply_rotary_pos_emb; this release is not covered by tfcompat "
            f"(tested {_version.MIN_TRANSFORMERS} to {_version.TESTED_MAX_TRANSFORMERS}); please report it"
        )
    fn = module.function(name) or _Def(name, (), "")
    rotation = fam.rotation
    if rotation == "deinterleave" and name != "apply_rotary_pos_emb_interleave":
        # GLM-5 (glm_moe_dsa) 5.3-5.5 rotate the rope part of its MLA heads as plain NeoX halves
        rotation = "neox"
        reason += "; NeoX halves (this release does not call apply_rotary_pos_emb_interleave)"
    single = len(fn.params) > 1 and fn.params[1] == "cos"  # apply_rotary_pos_emb(x, cos, sin): one tensor a call
    if single:
        reason += "; the function rotates one tensor per call"
    gptj_cos = ""
    if fam.rotation == "gptj":
        # GLM before 5.17 halves cos and repeat-interleaves it inside the apply function;
        # from 5.17 the rotary module emits the interleaved layout (probed below, not assumed).
        gptj_cos = _probe(capability, "the GPT-J cos layout", fn,
                          lambda b: "half" if "repeat_interleave" in b else "pairs")
        layout = ("halved and repeat-interleaved by the attention" if gptj_cos == "half" else
                  "already interleaved by the rotary module")
        reason += f"; GPT-J pairs, cos {layout}"
    plan = RopePlan(rotation=rotation, cos_rows=rows, gptj_cos=gptj_cos, mrope=fam.mrope, single=single)
    return Resolution(capability, name, f"{module.name}.{name}", reason,
                      str(_version.transformers_version()), plan, (module.name, name))


_SECTION_DEFAULT = re.compile(r"""get\(\s*["']mrope_section["']\s*,\s*\[([\d,\s]+)\]""")


#: the default init taking its rotary width from the MLA rope part (``head_dim = config.qk_rope_head_dim``)
_DIM_KEY = re.compile(r"=\s*config\.qk_rope_head_dim\b")


def _resolve_rope_init(fam, capability):
    module = _modeling(fam, capability)
    if fam.nope:
        return _nope(fam, capability, module, RopeInitPlan(config_key="", reads_partial_rotary=False))
    init = _method(module, fam.rotary, "__init__", capability)
    default = module.method(fam.rotary, "compute_default_rope_parameters")
    if default is not None:
        # 5.x: a per-model staticmethod reads config.rope_parameters (transformers 5.0.0)
        reads_partial = _probe(capability, "whether partial_rotary_factor is read", default,
                               lambda b: "partial_rotary_factor" in b,
                               _NO_FACT if fam.reads_partial_rotary == PROBE_ONLY else fam.reads_partial_rotary)
        dim_key = _probe(capability, "which config attribute gives the rotary width", default,
                         lambda b: "qk_rope_head_dim" if _DIM_KEY.search(b) else "", "")
        key, impl = "rope_parameters", "compute_default_rope_parameters"
        source = f"{module.name}.{fam.rotary}.compute_default_rope_parameters"
        reason = f"{fam.rotary} has compute_default_rope_parameters (config.rope_parameters)"
        if dim_key:
            reason += f"; its rotary width is config.{dim_key}"
    else:
        key, impl, reads_partial, source, reason = transformers4.rope_init(fam, module.name)
        dim_key = ""

    def default_section(body):
        match = _SECTION_DEFAULT.search(body)
        return tuple(int(x) for x in match.group(1).split(",") if x.strip()) if match else None

    declared = fam.default_mrope_section if fam.mrope != "none" else None
    section = _probe(capability, "the default mrope_section", init, default_section,
                     _NO_FACT if declared == PROBE_ONLY else declared)
    if section:
        reason += f"; rotary module defaults mrope_section to {list(section)}"
    plan = RopeInitPlan(config_key=key, reads_partial_rotary=reads_partial, default_mrope_section=section,
                        dim_key=dim_key)
    return Resolution(capability, impl, source, reason, str(_version.transformers_version()), plan,
                      (module.name, fam.rotary))


def _resolve_attention(fam, capability):
    module = _modeling(fam, capability)
    forward = _method(module, fam.attention, "forward", capability)
    returns = _probe(capability, "the attention's return arity", forward, lambda b: 3 if re.search(
        r"return\s+attn_output\s*,\s*attn_weights\s*,\s*past_key_value", b) else 2)
    text_model = next((n for n in (f"{fam.prefix}TextModel", f"{fam.prefix}Model") if module.has(n)), "")
    if not text_model:
        raise UnsupportedTransformersError(f"{capability}: no {fam.prefix}TextModel / {fam.prefix}Model in "
                                           f"{module.name}")
    four = _probe(capability, "whether the text model splits 4-row position ids",
                  _method(module, text_model, "forward", capability),
                  lambda b: bool(re.search(r"shape\[0\]\s*==\s*4", b)))
    linear = f"{fam.prefix}GatedDeltaNet" if module.has(f"{fam.prefix}GatedDeltaNet") else ""
    gated = _probe(capability, "whether the query projection carries an output gate", forward,
                   lambda b: bool(re.search(r"sigmoid\(\s*gate\s*\)", b)))
    ids = ("splits 4-row position ids" if four else
           "takes 3-row position ids only (tfcompat strips the text row)" if fam.vision else "takes 2-D position ids")
    params = forward.params
    reason = f"{fam.attention}.forward({', '.join(params)}) returns a {returns}-tuple; {text_model}.forward {ids}"
    if gated:
        reason += "; q_proj holds the query and a sigmoid output gate per head"
    plan = AttentionPlan(params, returns, text_model, four, linear, gated)
    return Resolution(capability, "bundled", f"{module.name}.{fam.attention}.forward",
                      reason, str(_version.transformers_version()), plan, (module.name, ""))


def _resolve_carrier(fam, capability):
    """How a packed step reaches the attention kernel (probes in :mod:`.carrier`): ``interface`` where the installed
    attention forward hands its call and ``**kwargs`` to ``ALL_ATTENTION_FUNCTIONS`` (tfcompat keeps upstream's forward
    and serves the call), else ``forward`` (tfcompat's bundled forward, ``_attention/bundled.py``)."""
    module = _modeling(fam, capability)
    forward = _method(module, fam.attention, "forward", capability)
    routed = _probe(capability, "whether the attention calls ALL_ATTENTION_FUNCTIONS with its kwargs", forward,
                    _carrier.routes)
    text_model = resolve("attention.signature", fam.name).plan.text_model
    plan = CarrierPlan(*_carrier.kwargs_reach(module, text_model)) if routed else None
    if routed:
        reason = (f"{fam.attention}.forward looks up ALL_ATTENTION_FUNCTIONS by config._attn_implementation and passes "
                  f"its **kwargs: upstream's forward runs, tfcompat's registered attention function serves a packed "
                  f"step (eager, sdpa and flex calls go to upstream's own function)")
        ready = "; it takes ready-made masks by layer type: a packed step hands None for each" * plan.masks_by_type
        reason += (f"; the text model hands its **kwargs to each {plan.layer}, which hands them to the attention: "
                   f"the step rides there{ready}" if plan.kwargs_reach else "; the step rides on the rotary module's "
                   "output (the text model's **kwargs do not reach the attention)")
    else:
        reason = (f"{fam.attention}.forward does not call ALL_ATTENTION_FUNCTIONS with its **kwargs "
                  f"(per-implementation classes or its own kernel call): tfcompat's bundled attention forward serves "
                  f"a packed step")
    return Resolution(capability, "interface" if routed else "forward", f"{module.name}.{fam.attention}.forward",
                      reason, str(_version.transformers_version()), plan, (module.name, fam.attention))


def _resolve_rope_index(fam, capability):
    if not fam.vision or fam.embeds_refusal:
        raise TfcompatError(f"{capability}: tfcompat.embeds.rope_index serves vision families; {fam.name} is "
                            f"{'refused by it: ' + fam.embeds_refusal if fam.embeds_refusal else 'a text family'}")
    module = _modeling(fam, capability)
    for owner in (f"{fam.prefix}Model", f"{fam.prefix}ForConditionalGeneration"):
        fn = module.method(owner, "get_rope_index")
        if fn is not None:
            break
    else:
        raise UnsupportedTransformersError(
            f"{capability}: transformers {_version.transformers_version()} has no get_rope_index on "
            f"{fam.prefix}Model or {fam.prefix}ForConditionalGeneration")
    splits = _probe(capability, "whether get_rope_index splits video grids per frame", fn, splits_video_frames)
    reason = f"{owner}.get_rope_index({', '.join(fn.params)})"
    if fam.video_block_per_frame:  # every video frame is its own vision block
        reason += ("; splits video grids per frame itself" if splits else
                   "; reads one grid row per frame block: tfcompat splits video grids per frame")
    return Resolution(capability, "get_rope_index", f"{module.name}.{owner}.get_rope_index", reason,
                      str(_version.transformers_version()), RopeIndexPlan(owner, splits, fn.params),
                      (module.name, owner))


def splits_video_frames(body):
    """The probe of a ``get_rope_index`` source: does it split video grids per frame (or take no videos)?"""
    return "repeat_interleave(video_grid_thw" in body or "video" not in body


def _resolve_window(fam, capability):
    """Named: the windowed layers are read per model at patch() time (:mod:`.window`)."""
    _modeling(fam, capability)
    text = _read(fam.configuration)
    has = text is None or "sliding_window" in text
    reason = ("per model at patch(): each attention module's sliding_window (4.51-4.52: the one mask every layer "
              "shares); PatchRecord.windows lists each layer's window") if has else \
        "the config has no sliding_window: every layer attends to every earlier key"
    return Resolution(capability, "per layer" if has else "none", f"{fam.configuration}.{fam.config_class}",
                      reason, str(_version.transformers_version()), None, (fam.configuration, fam.config_class))


_RESOLVERS = {
    "rope.apply": _resolve_rope_apply,
    "rope.init": _resolve_rope_init,
    "attention.signature": _resolve_attention,
    "attention.window": _resolve_window,
    "attention.carrier": _resolve_carrier,
    "rope_index": _resolve_rope_index,
}


# ------------------------------------------------------------------------------ the cache
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
        # a composite running another family's text decoder (GLM-4.6V: GLM-4V's) is resolved in that family's
        # modeling module, under its own name (rope_index belongs to the composite itself)
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
    environment's kernel choices come first in :func:`tfcompat.report`, from :mod:`.backends`).

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
