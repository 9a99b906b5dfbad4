"""The ``attention.carrier`` probes, read from the installed modeling source: does the attention forward hand its call
to the function registered with ``AttentionInterface``, and do the text model's ``**kwargs`` reach it."""

import re

#: an attention forward that looks its attention function up in upstream's registry by the config's key and hands
#: it its own ``**kwargs`` (what ``AttentionInterface.register`` serves)
_LOOKS_UP = re.compile(r"ALL_ATTENTION_FUNCTIONS")
_HANDS_KWARGS = re.compile(r"attention_interface\((?:[^()]|\([^()]*\))*\*\*kwargs\s*,?\s*\)")
#: the text model's decoder layer class (its ``__init__`` builds them), the layer call that hands the text model's
#: keyword arguments on (4.51-4.56 name them ``flash_attn_kwargs``), the attention call that hands the layer's on
_LAYER_CLASS = re.compile(r"\b(\w+DecoderLayer)\(")
_LAYER_GETS_KWARGS = re.compile(r"decoder_layer\((?:[^()]|\([^()]*\))*\*\*(?:kwargs|flash_attn_kwargs)\s*,?\s*\)")
_ATTENTION_GETS_KWARGS = re.compile(r"self\.self_attn\((?:[^()]|\([^()]*\))*\*\*kwargs\s*,?\s*\)")
#: a linear-attention mixer's call (Qwen3-Next, Qwen3.5), and that call handing the layer's kwargs on
_LINEAR_CALL = re.compile(r"self\.linear_attn\(")
_LINEAR_GETS_KWARGS = re.compile(r"self\.linear_attn\((?:[^()]|\([^()]*\))*\*\*kwargs\s*,?\s*\)")
#: a text model that takes its masks ready-made, one per layer type, in ``attention_mask`` (what generate() hands it
#: under a static cache), and indexes them by each layer's type
_TAKES_MASKS = re.compile(r"isinstance\(\s*causal_mask_mapping\s*:=\s*attention_mask\s*,\s*dict\s*\)")
_MASK_BY_TYPE = re.compile(r"causal_mask_mapping\[\s*(?:self\.config\.layer_types\[\s*i\s*\]|decoder_layer\."
                           r"attention_type)\s*\]")


def routes(body):
    """Whether an attention forward's source calls ``ALL_ATTENTION_FUNCTIONS``' function with its ``**kwargs``."""
    return bool(_LOOKS_UP.search(body) and _HANDS_KWARGS.search(body))


def kwargs_reach(module, text_model):
    """Whether the text model's ``**kwargs`` reach its mixers: the text model's ``forward`` hands them to each decoder
    layer (the class its ``__init__`` builds), whose ``forward`` hands them to the attention and, where it calls one,
    to the linear mixer. Read from ``module`` (a modeling module as the probes read it); a source that cannot be read
    says no (the step then rides on the rotary module's output). Returns (whether, the decoder layer class's name,
    whether the text model takes its masks ready-made per layer type: ``CarrierPlan.masks_by_type``).
    """
    init, forward = module.method(text_model, "__init__"), module.method(text_model, "forward")
    layer = _LAYER_CLASS.search(init.body) if init is not None and init.body else None
    layer_forward = module.method(layer.group(1), "forward") if layer is not None else None
    body = layer_forward.body if layer_forward is not None else ""
    reach = bool(forward is not None and _LAYER_GETS_KWARGS.search(forward.body) and
                 _ATTENTION_GETS_KWARGS.search(body) and
                 (not _LINEAR_CALL.search(body) or _LINEAR_GETS_KWARGS.search(body)))
    masks = bool(forward is not None and _TAKES_MASKS.search(forward.body) and _MASK_BY_TYPE.search(forward.body))
    return reach, layer.group(1) if layer is not None else "", masks
