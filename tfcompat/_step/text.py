"""The text model's forward: decides the step once per call (the boundaries named, counted from the position ids,
or this rank's slice of the whole row's), checks it, and runs upstream's call inside it; generate()'s calls and
unpacked batches run upstream's own path. Installed by reference, as :mod:`.forwards`.
"""

from __future__ import annotations

from .._attention import boundaries as _boundaries
from .._attention import traced as _traced
from .._parallel import shards as _shards
from .._probe import resolve as _resolve
from ..errors import PackedCacheError, PackingError
from . import scope as _scope
from .install import (
    _ATTR,
    _CACHE_NAMES,
    _FLASH_KWARGS,
    _STEP,
    _arguments,
    _original,
    _recalled_explicit,
    _remember_explicit,
    _signature,
    decoding,
    rebind_restored,
)


def _find_step(state, group, explicit, position_ids, mask, batch, local, device, cached=False):
    """The step's boundaries (:func:`.._attention.boundaries.find_step`), decided from shapes where torch.compile traces
    (:func:`.._attention.traced.traced_step`)."""
    import torch

    find = _traced.traced_step if torch.compiler.is_compiling() else _boundaries.find_step
    return find(state, group, explicit, position_ids, mask, batch, local, device, cached)


def text_model_forward(self, *args, **kwargs):
    import torch

    state = getattr(self, _ATTR)
    if state.restored:  # unpickled: the layers' shared forwards are bound again, once
        rebind_restored(self)
    if torch.compiler.is_compiling() and (tied := _scope.innermost(_scope.TowersZero)) is not None and \
            tied.zero is not None:
        with _scope.carry(_scope.TowersZero(None)):  # this call takes it; a nested text model call does not
            return text_model_forward(self, **_tied(self, tied.zero, args, kwargs))
    explicit = {k: kwargs.pop(k) for k in _FLASH_KWARGS if k in kwargs}
    entry = _scope.call_entry()
    if not explicit and isinstance(entry, _scope.CallBoundaries):
        explicit = entry.kwargs
    given = _arguments(self, args, kwargs)
    if given is None:
        return _original(self, state, *args, **kwargs)  # upstream says what is wrong with the call
    inputs = given.get("input_ids") if given.get("input_ids") is not None else given.get("inputs_embeds")
    if inputs is None:
        return _original(self, state, *args, **kwargs)
    if explicit and entry is not None and torch.is_grad_enabled():
        _remember_explicit(state, inputs, explicit)
    elif not explicit and entry is None and (found := _recalled_explicit(state, inputs)) is not None:
        with _scope.carry(_scope.CallBoundaries(found)):  # a checkpoint recomputing this call: same boundaries
            return text_model_forward(self, *args, **kwargs)
    seen = _boundaries.check_position_shape(state.family, given.get("position_ids"), inputs.shape[0], inputs.shape[1])
    if (state.split() or state.group_lost) and not explicit and decoding(given):
        return _decode_under_group(self, state, given, seen, inputs, args, kwargs)
    state.group_or_raise()
    split = state.split()  # the sequence groups: Ulysses, context parallel, or both
    if split and state.slice_inputs:
        given = _shards.slice_whole_row(self, state, given, explicit)
        inputs = given["inputs_embeds"]
    elif split:  # this rank's slice; beside the whole row's boundaries its positions come from them
        named = _boundaries.explicit_cu(explicit) is not None
        _shards.check_shards(state, split.values(), inputs.shape[1], inputs.shape[0], inputs, given.get("position_ids"),
                             named=named)
        given["position_ids"] = _shards.shard_positions(state, explicit, given.get("position_ids"), inputs.shape[1],
                                                    inputs.device)
    batch, local = inputs.shape[0], inputs.shape[1]
    # a split row's positions were sliced or made above: checked again; else those checked before
    position_ids = _boundaries.check_position_shape(state.family, given.get("position_ids"), batch, local) if split \
        else seen
    _check_mask_length(state, given, batch, local)
    changed = {}
    plan = state.plan or _resolve.resolve("attention.signature", state.family).plan  # bound at patch time
    if position_ids is not None and position_ids.dim() == 3 and position_ids.shape[0] == 4 and not plan.four_row_ids:
        changed["position_ids"] = position_ids[1:]  # this release's text model predates the 4-row layout
    step = _find_step(state, _scope.first(split.values()), explicit, position_ids, given.get("attention_mask"), batch,
                      local, inputs.device, cached=_caching(self, given))
    if step is None:
        return _unpacked(self, state, given, position_ids, changed, args, kwargs)
    return _packed(self, state, given, step, changed)


def _tied(self, zero, args, kwargs):
    """A traced text-only VL step's call (as keyword arguments) with the towers' zero term added to its input
    embeddings."""
    from .dummy import tie_zero

    given = _arguments(self, args, kwargs)
    if given is None or given.get("inputs_embeds") is None:
        raise PackingError(f"tfcompat {getattr(self, _ATTR).family}: the text model of a traced text-only step was "
                           f"called without inputs_embeds; please report it with the transformers release")
    given["inputs_embeds"] = tie_zero(given["inputs_embeds"], zero)
    return given


def _caching(self, given):
    """Whether the call decodes or makes a KV cache: a cache passed, or outside training ``use_cache`` (passed,
    or the config's: a rollout's prefill). Read under torch.compile only, where a row that holds one sequence cannot be
    told from a packed one by its values: such a call runs upstream's path (which makes the cache, as eagerly)
    and a packed row in it is refused by a device-side check."""
    if any(given.get(n) is not None for n in _CACHE_NAMES):
        return True
    if self.training:  # a training step's use_cache (the config's, or a VL top model's resolved one) makes none
        return False
    use = given.get("use_cache")
    if use is None:
        # left to the config's default: eagerly a packed row turns it off; a row named by no cache and no
        # cache_position is not generate()'s, so it runs tfcompat's path compiled too (which returns no cache)
        return decoding(given)
    return bool(use) or decoding(given)


def _decode_under_group(self, state, given, seen, inputs, args, kwargs):
    """generate() with the policy being trained (an RL rollout): every rank decodes its own batch with its own
    KV cache, as the unpatched model does; nothing is split (a training slice carries no cache). A packed row
    cannot be decoded so (its sequences would share the cache): refused, as without a group."""
    if _find_step(state, None, {}, seen, given.get("attention_mask"), inputs.shape[0], inputs.shape[1],
                  inputs.device) is not None:
        raise _packed_with_cache(state, "a KV cache or cache_position")
    return _original(self, state, *args, **kwargs)


def _check_mask_length(state, given, batch, local):
    mask = given.get("attention_mask")
    if getattr(mask, "dim", lambda: 0)() == 2 and mask.shape[-1] != local and \
            not any(given.get(n) is not None for n in _CACHE_NAMES):
        raise PackingError(
            f"tfcompat {state.family}: attention_mask of shape {tuple(mask.shape)} for an input of {local} tokens "
            f"and no KV cache (only a cache makes a mask longer than the input); pass a ({batch}, {local}) mask, "
            f"or none for a packed row")


def _unpacked(self, state, given, position_ids, changed, args, kwargs):
    """Not a packed step: upstream's own call, with 3-row ids given a mask of ones (and 4-row ids cut to 3 rows
    on releases that predate them)."""
    import torch

    inputs = given.get("input_ids") if given.get("input_ids") is not None else given.get("inputs_embeds")
    if position_ids is not None and position_ids.dim() == 3 and given.get("attention_mask") is None and \
            "attention_mask" in _signature(type(self)).parameters:
        # the numbers of a mask of ones (one unpadded sample per row); transformers 4.53-4.57 crash building
        # the causal mask from 3-row ids without a mask (Qwen2-VL, GLM-4V), and 5.x would read the temporal
        # row as packed-sequence starts. With a KV cache (generate()), the mask covers the cached tokens too.
        cache = _scope.first((given[n] for n in _CACHE_NAMES if given.get(n) is not None), None)
        past = int(cache.get_seq_length()) if hasattr(cache, "get_seq_length") else 0
        changed["attention_mask"] = torch.ones((inputs.shape[0], past + inputs.shape[1]), dtype=torch.long,
                                               device=inputs.device)
    if changed:
        given.update(changed)
        return _original(self, state, **given)
    return _original(self, state, *args, **kwargs)


def _packed_with_cache(state, what):
    """One refusal, one class, with or without a sequence group: a packed row (or a slice of one) and a cache."""
    return PackedCacheError(f"tfcompat {state.family}: a packed row (or a sequence-parallel slice of one) was passed "
                            f"with {what}; sequences of a packed row cannot share one cache; pass use_cache=False "
                            f"and no past_key_values for training, or unpack the row for generation")


def _packed(self, state, given, step, changed):
    """A packed step: upstream's call with no cache and a mask of ones, inside the step's scope (the rotary
    module hands the step to the layers on the position embeddings)."""
    import torch

    cache = _scope.first((given[n] for n in _CACHE_NAMES if given.get(n) is not None), None)
    if cache is not None:
        raise _packed_with_cache(state, f"a KV cache ({type(cache).__name__})")
    if given.get("output_attentions"):
        raise PackingError(
            f"tfcompat {state.family}: output_attentions=True on a packed row (or Ulysses shard): the packed "
            f"attention computes no weight matrix; call the unpatched model on the padded batch to inspect weights"
        )
    inputs = given.get("input_ids") if given.get("input_ids") is not None else given.get("inputs_embeds")
    if "use_cache" in _signature(type(self)).parameters or "use_cache" in given:
        changed["use_cache"] = False  # no cache for a packed row: the configs' default would create one
    if state.masks is not None:  # the masks ready-made, none for any layer: upstream builds no (tokens, tokens) mask
        changed["attention_mask"] = dict.fromkeys(state.masks)
    elif "attention_mask" in _signature(type(self)).parameters:
        # an explicit all-ones mask keeps upstream mask builders from re-reading packed position ids
        # (some releases cannot parse 3-row ids there); the patched attention does not use it
        changed["attention_mask"] = torch.ones(tuple(inputs.shape[:2]), dtype=torch.long, device=inputs.device)
    given.update(changed)
    if state.rides:  # down the layers' own kwargs to the attention (a checkpoint replays them)
        given[_STEP] = step
    with _scope.carry(_scope.RunningStep(step, state.owner)):
        return _original(self, state, **given)

