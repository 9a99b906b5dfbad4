"""A user's model scaled down for ``tfcompat check --config``: every setting that decides RoPE and attention
kept, the widths and depths that only cost time made tiny.

Kept from the loaded config (as ``from_pretrained`` of this release read it): head_dim, the ratio of query
to key/value heads, the RoPE settings (theta, type and scaling, mRoPE sections and interleaving, partial
rotary, the MLA rotary/latent widths), the sliding-window settings and layer types (a prefix of the stack
long enough to hold every layer kind: a windowed and a full layer where both exist, the linear-attention
pattern), attention biases, MoE routing (top-k, normalisation, sparse steps), tied embeddings.
Made tiny: hidden and MLP widths, expert count and widths, layer count, the vocabulary (256 tokens: the token
ids of images and videos are renumbered into it; ids decide no RoPE or attention number) and the vision tower
(the tiny one of the family: a tower's widths and depth do not reach the text model's positions, its merge
size does and is kept: 1, 2 or 4).
"""

from __future__ import annotations

from typing import Any

from .._probe.drift import load_config
from ..errors import ConfigError

__all__ = ["load_config", "scaled_config", "KEPT"]

#: text settings taken from the user's config as loaded (present ones only)
KEPT = ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "head_dim", "max_position_embeddings",
        "use_sliding_window", "sliding_window", "max_window_layers", "attention_bias", "qkv_bias",
        "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step", "full_attention_interval",
        "tie_word_embeddings", "rope_interleave", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
        "use_qk_norm", "routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace")
_MAX_LAYERS = 64


def _layer_count(text) -> int:
    """A prefix of the stack that holds every kind of layer the model has (at least 2)."""
    total = int(getattr(text, "num_hidden_layers", 2) or 2)
    need = 2
    types = getattr(text, "layer_types", None)
    if types:
        need = max(need, max(list(types).index(kind) for kind in set(types)) + 1)
    if getattr(text, "use_sliding_window", False) and getattr(text, "max_window_layers", None) is not None:
        need = max(need, int(text.max_window_layers) + 1)  # a layer on each side of the boundary
    interval = getattr(text, "full_attention_interval", None)
    if interval:
        need = max(need, int(interval))
    sparse = getattr(text, "decoder_sparse_step", None)
    if sparse:
        need = max(need, int(sparse))
    first_dense = getattr(text, "first_k_dense_replace", None)
    if first_dense:
        need = max(need, int(first_dense) + 1)
    return min(total, need, _MAX_LAYERS)


def _rope_facts(config: Any) -> Any:
    """The RoPE facts of ``config`` that decide every rotary number (None: a decoder without RoPE)."""
    from .._probe.families import family
    from ..config import rope_parameters

    if family(config).nope:
        return None
    rp = rope_parameters(config)
    return {"rope_type": rp.rope_type, "rope_theta": rp.rope_theta, "head_dim": rp.head_dim,
            "rotary_dim": rp.rotary_dim, "partial_rotary_factor": rp.partial_rotary_factor,
            "mrope_section": rp.mrope_section, "scaling": dict(rp.scaling)}


def _fewer_experts(text, kept, layers):
    """MoE settings scaled down: the MLP-only layers that remain, and at least 4 experts (twice top-k)."""
    out: dict = {}
    mlp_only = getattr(text, "mlp_only_layers", None)
    if mlp_only:
        out["mlp_only_layers"] = [i for i in mlp_only if i < layers]
    experts = next((getattr(text, k) for k in ("num_experts", "n_routed_experts", "num_local_experts")
                    if getattr(text, k, None)), None)
    top_k = kept.get("num_experts_per_tok")
    if experts and top_k:
        small = max(4, 2 * int(top_k)) if int(top_k) * 2 <= int(experts) else int(experts)
        for k in ("num_experts", "n_routed_experts", "num_local_experts"):
            if getattr(text, k, None):
                out[k] = small
    return out


def _small_kv(kv: int, ratio: int, ulysses: int) -> int:
    """The scaled model's key/value heads (its query heads: that times ``ratio``, the real ratio). Alone: 1 or 2.
    For a Ulysses degree N, the facts that decide how heads split over N ranks are kept: N divides the kv heads
    (then N kv heads: each rank one), or it does not (then the real kv count, repeated as the real model's is);
    the query heads, kv times the real ratio, are then divisible by N exactly when the real ones are."""
    if ulysses <= 1:
        return 1 if ratio >= 4 else 2
    return ulysses if kv % ulysses == 0 else kv


def _why(key: str) -> str | None:
    """Why a setting of the user's config was changed in the scaled model (None: a key not reported)."""
    if key in ("num_experts", "n_routed_experts", "num_local_experts"):
        return "at least 4 experts and twice top-k: the routing settings kept"
    if key == "num_hidden_layers":
        return "a prefix of the stack holding every kind of layer"
    if key in ("layer_types", "mlp_only_layers"):
        return "the entries of the layers kept"
    if key == "sliding_window":
        return "a window of 4 tokens on longer sequences: which layers window is kept"
    if key == "vocab_size":
        return "256 tokens, the special and image ids renumbered into them: ids decide no RoPE or attention number"
    if key == "hidden_size":
        return "query heads x head_dim"
    if key.endswith(("_size", "_dim", "_rank", "_heads")) or "intermediate" in key:
        return "a width: decides no RoPE or attention number"
    return None


def _changed(text: Any, small: Any, kept: dict) -> dict:
    """Every setting of the user's text config the scaled one sets otherwise: ``{key: (theirs, ours, why)}``."""
    out = {}
    for key, theirs in vars(text).items():
        ours = getattr(small, key, None)
        why = _why(key)
        if key in kept and key not in ("sliding_window", "layer_types") or why is None or ours == theirs:
            continue
        if ours is None:
            continue  # a key the scaled config does not carry (an unused setting the file keeps): not scaled
        if isinstance(theirs, (int, list)) and not isinstance(theirs, bool):
            if isinstance(theirs, list) and len(theirs) > 8:
                theirs = f"[{len(theirs)} entries]"
            out[key] = (theirs, ours, why)
    return out


def scaled_config(config: Any, ulysses: int = 1) -> tuple[Any, dict, dict]:
    """``(tiny config of the same family, the settings kept, the settings changed)`` for a loaded config; the
    changed ones as ``{key: (the config's value, the scaled value, why)}``. ``ulysses``: keep the facts that decide
    how the heads split over that many Ulysses ranks (``check --ulysses N``)."""
    from .._probe.families import family
    from ..config import text_config
    from ..testing import tiny_config

    fam = family(config)
    text = text_config(config)
    want = _rope_facts(config)  # what the user's model computes; the scaled one must compute the same
    heads = int(text.num_attention_heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    if heads % kv:
        raise ConfigError(f"tfcompat check: {heads} attention heads do not divide into {kv} key/value heads")
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    ratio = heads // kv
    small_kv = _small_kv(kv, ratio, ulysses)
    kept: dict[str, Any] = {k: getattr(text, k) for k in KEPT if k in vars(text) and getattr(text, k) is not None}
    layers = _layer_count(text)
    overrides = dict(kept, num_attention_heads=small_kv * ratio, num_key_value_heads=small_kv,
                     head_dim=int(head_dim), hidden_size=small_kv * ratio * int(head_dim), num_hidden_layers=layers)
    window = kept.get("sliding_window")
    if isinstance(window, int) and window > 4:
        overrides["sliding_window"] = 4  # a width: which layers window is kept; the rows are longer than 4
    types = getattr(text, "layer_types", None)
    if types:
        overrides["layer_types"] = list(types)[:layers]
    overrides.update(_fewer_experts(text, kept, layers))
    if want is not None and "partial_rotary_factor" not in kept:
        # not set by the user: the release's default for this config, never the tiny config's own factor
        overrides["partial_rotary_factor"] = want["partial_rotary_factor"]
    if fam.vision:
        merge = getattr(getattr(config, "vision_config", None), "spatial_merge_size", None)
        if merge is not None:
            if int(merge) not in (1, 2, 4):
                raise ConfigError(f"tfcompat check: spatial_merge_size {merge}: the scaled tower's 4x4-patch "
                                  f"images merge by 1, 2 or 4 only")
            overrides["vision_config"] = {"spatial_merge_size": int(merge)}
    try:
        scaled = tiny_config(fam.name, **overrides)
    except Exception as exc:
        raise ConfigError(f"tfcompat check: the {fam.name} config class of this release refuses the scaled "
                          f"settings {sorted(overrides)}: {type(exc).__name__}: {exc}") from None
    got = _rope_facts(scaled)
    differ = sorted(k for k in (want or {}) if got is not None and got[k] != want[k])
    if differ:
        raise ConfigError(f"tfcompat check: the scaled-down {fam.name} model would compute RoPE differently "
                          f"({', '.join(f'{k}: {want[k]} -> {got[k]}' for k in differ)}); nothing was checked")
    return scaled, *_report(text, scaled, kept, overrides, (heads, kv, small_kv, ratio, ulysses))


def _report(text, scaled, kept, overrides, heads_facts):
    """``(the settings kept, the settings changed)`` of a scaled config, as ``check --config`` prints them."""
    from ..config import text_config

    heads, kv, small_kv, ratio, ulysses = heads_facts
    shown = {k: v for k, v in overrides.items() if k in KEPT and k not in ("sliding_window",)}
    if "sliding_window" in kept and overrides.get("sliding_window") == kept["sliding_window"]:
        shown["sliding_window"] = kept["sliding_window"]
    for key in ("rope_scaling", "rope_parameters"):  # 'type' is the legacy alias transformers keeps beside rope_type
        if isinstance(shown.get(key), dict) and "rope_type" in shown[key]:
            shown[key] = {k: v for k, v in shown[key].items() if k != "type"}
    if "vision_config" in overrides:
        shown["vision.spatial_merge_size"] = overrides["vision_config"]["spatial_merge_size"]
    changed = _changed(text, text_config(scaled), kept)
    changed.pop("num_attention_heads", None)
    changed.pop("num_key_value_heads", None)
    if (small_kv * ratio, small_kv) == (heads, kv):
        shown["heads"] = f"{heads}/{kv}"
    else:
        changed = {"heads": (f"{heads}/{kv}", f"{small_kv * ratio}/{small_kv}", f"query/kv heads, the ratio {ratio} "
                             "kept" + (f" and how they split over {ulysses} Ulysses ranks" if ulysses > 1 else "")),
                   **changed}
    return shown, changed
