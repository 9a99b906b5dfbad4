"""What only transformers 4.51-4.57 needs. Each function names the upstream change it absorbs; all of it
goes when the matrix drops 4.x (5.0 made every one of these shapes uniform)."""

import inspect


def rope_init(fam, module_name):
    """The default RoPE init of a 4.x rotary module (it has no ``compute_default_rope_parameters``).

    Absorbs: transformers 5.0 moved the default init into a per-model staticmethod that reads
    ``config.rope_parameters``; 4.x calls ``ROPE_INIT_FUNCTIONS["default"]``, which reads
    ``config.rope_theta`` and ``partial_rotary_factor`` from ``config.rope_scaling``-era configs.
    Returns ``(config_key, impl, reads_partial_rotary, source, reason)``."""
    return ("rope_scaling", "_compute_default_rope_parameters", True,
            "transformers.modeling_rope_utils._compute_default_rope_parameters",
            f"{fam.rotary} has no compute_default_rope_parameters: 4.x rope_scaling/rope_theta config")


def rope_scaling(cfg):
    """The 4.x RoPE dict: ``config.rope_scaling`` (None for unscaled models).

    Absorbs: transformers 5.0 renamed it ``rope_parameters`` (with ``rope_theta`` inside) and made
    ``rope_scaling`` an alias property."""
    return cfg.__dict__.get("rope_scaling")


def tiny_rope_kwargs(rope, theta, partial):
    """Tiny-config RoPE settings in the 4.x spelling: top-level ``rope_theta`` and
    ``partial_rotary_factor``, and ``rope_scaling`` (None when it would only say "default")."""
    kw = {"rope_theta": theta, "rope_scaling": rope if len(rope) > 1 else None}
    if partial is not None:
        kw["partial_rotary_factor"] = partial
    return kw


def flat_vl_config(cls, vision, ids, text):
    """A tiny Qwen2-VL config of 4.51: text settings flat on the top-level config.

    Absorbs: 4.52 gave Qwen2-VL/2.5-VL a ``text_config`` (``Qwen2VLTextConfig``)."""
    return cls(vision_config=vision, **ids, **text)


def qwen3_vl_visual_output(output):
    """``(embeds, deepstack)`` when ``output`` is the 4.57 Qwen3-VL vision tower's plain 2-tuple
    ``(embeds or per-image tuple, [deepstack per layer])``; None for any other output.

    Absorbs: 5.0 returns ``BaseModelOutputWithDeepstackFeatures`` (read through ``pooler_output``)."""
    if isinstance(output, (tuple, list)) and len(output) == 2 and isinstance(output[1], (tuple, list)):
        return output[0], output[1]
    return None


def one_mask(fam, release):
    """Where this release builds one sliding-window mask for every layer of ``fam``'s text model: ``"set"`` (wherever
    ``sliding_window`` is set, even with ``use_sliding_window: false``), ``"used"`` (where ``use_sliding_window`` is
    true too; ``max_window_layers`` unread), or None (each attention module holds its own window).

    Absorbs: 4.53 gave each layer its own mask type (``layer_types``), and Qwen2-MoE followed in 5.0 (the family
    table's ``one_mask``, measured against each release's eager attention)."""
    for before, when in fam.one_mask:
        if tuple(release) < before:
            return when
    return None


def sliding_window(module):
    """The sliding window of a 4.x attention module that has no ``sliding_window`` attribute.

    Absorbs: before 4.53 the Qwen2 family decided per call from the config (``use_sliding_window``,
    ``max_window_layers`` against the layer index); 4.53+ stores it on the module."""
    config = module.config
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None) and \
            getattr(module, "layer_idx", 0) >= getattr(config, "max_window_layers", 0):
        return config.sliding_window
    return None


__all__ = [name for name, obj in dict(globals()).items() if inspect.isfunction(obj)]
