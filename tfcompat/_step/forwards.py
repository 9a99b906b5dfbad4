"""The patched forwards: the text model (decides the step), the model patch() was given, the module owning the
vision tower, the rotary module (carries the step), the decoder layers, the attention and the linear-attention
mixers. Each is a module-level function of ``(module, *args, **kwargs)``, installed by reference.
"""

from __future__ import annotations

from .._probe import resolve as _resolve
from ..errors import PackingError, TfcompatError, UlyssesError
from . import boundaries as _boundaries
from . import scope as _carrier
from . import shards as _shards
from .install import (
    _ATTR,
    _CACHE_NAMES,
    _FLASH_KWARGS,
    _arguments,
    _Carried,
    _original,
    _recalled_explicit,
    _remember_explicit,
    _signature,
    _StepMask,
)

__all__ = ["FORWARDS"]


# ------------------------------------------------------------------------------ text model
def _text_model_forward(self, *args, **kwargs):
    import torch

    state = getattr(self, _ATTR)
    explicit = {k: kwargs.pop(k) for k in _FLASH_KWARGS if k in kwargs}
    entry = _carrier.call_entry()
    if not explicit and isinstance(entry, _carrier.Named):
        explicit = entry.kwargs
    a = _arguments(self, args, kwargs)
    if a is None:
        return _original(self, state, *args, **kwargs)  # upstream says what is wrong with the call
    ref = a.get("input_ids") if a.get("input_ids") is not None else a.get("inputs_embeds")
    if ref is None:
        return _original(self, state, *args, **kwargs)
    if explicit and entry is not None and torch.is_grad_enabled():
        _remember_explicit(ref, explicit)
    elif not explicit and entry is None and (found := _recalled_explicit(ref)) is not None:
        with _carrier.carry(_carrier.Named(found)):  # a checkpoint's recomputation of this call: the same boundaries
            return _text_model_forward(self, *args, **kwargs)
    seen = _boundaries.check_position_shape(state.family, a.get("position_ids"), ref.shape[0], ref.shape[1])
    if (state.split() or state.group_lost) and not explicit and _decoding(a):
        return _decode_under_group(self, state, a, seen, ref, args, kwargs)
    state.group_or_raise()
    split = state.split()  # the sequence groups: Ulysses, context parallel, or both
    if split and state.slice_inputs:
        a = _shards.slice_whole_row(self, state, a, explicit)
        ref = a["inputs_embeds"]
    elif split:  # this rank's slice; beside the whole row's boundaries its positions come from them
        named = _boundaries.explicit_cu(explicit) is not None
        _shards.check_shards(state, split.values(), ref.shape[1], ref.shape[0], ref, a.get("position_ids"),
                             named=named)
        a["position_ids"] = _shards.shard_positions(state, explicit, a.get("position_ids"), ref.shape[1],
                                                    ref.device)
    batch, local = ref.shape[0], ref.shape[1]
    position_ids = _boundaries.check_position_shape(state.family, a.get("position_ids"), batch, local)
    _check_mask_length(state, a, batch, local)
    changed = {}
    plan = _resolve.resolve("attention.signature", state.family).plan
    if position_ids is not None and position_ids.dim() == 3 and position_ids.shape[0] == 4 and not plan.four_row_ids:
        changed["position_ids"] = position_ids[1:]  # this release's text model predates the 4-row layout
    step = _boundaries.find_step(state, next(iter(split.values()), None), explicit, position_ids,
                                 a.get("attention_mask"), batch, local, ref.device)
    if step is None:
        return _unpacked(self, state, a, position_ids, changed, args, kwargs)
    return _packed(self, state, a, step, changed)


def _decoding(a):
    """generate()'s call: a KV cache, or (5.0-5.2 prefill, which creates the cache) cache_position with caching."""
    return any(a.get(n) is not None for n in _CACHE_NAMES) or \
        (a.get("cache_position") is not None and a.get("use_cache") is not False)


def _decode_under_group(self, state, a, seen, ref, args, kwargs):
    """generate() with the policy being trained (an RL rollout): every rank decodes its own batch with its own
    KV cache, as the unpatched model does; nothing is split (a training slice carries no cache). A packed row
    cannot be decoded so (its sequences would share the cache): refused, as without a group."""
    if _boundaries.find_step(state, None, {}, seen, a.get("attention_mask"), ref.shape[0], ref.shape[1],
                             ref.device) is not None:
        raise UlyssesError(f"tfcompat {state.family}: a packed row (or a sequence-parallel slice of one) was "
                           f"passed with a KV cache or cache_position; pass use_cache=False and no "
                           f"past_key_values for training, or unpack the row for generation")
    return _original(self, state, *args, **kwargs)


def _check_mask_length(state, a, batch, local):
    mask = a.get("attention_mask")
    if getattr(mask, "dim", lambda: 0)() == 2 and mask.shape[-1] != local and \
            not any(a.get(n) is not None for n in _CACHE_NAMES):
        raise PackingError(
            f"tfcompat {state.family}: attention_mask of shape {tuple(mask.shape)} for an input of {local} tokens "
            f"and no KV cache (only a cache makes a mask longer than the input); pass a ({batch}, {local}) mask, "
            f"or none for a packed row")


def _unpacked(self, state, a, position_ids, changed, args, kwargs):
    """Not a packed step: upstream's own call, with 3-row ids given a mask of ones (and 4-row ids cut to 3 rows
    on releases that predate them)."""
    import torch

    ref = a.get("input_ids") if a.get("input_ids") is not None else a.get("inputs_embeds")
    if position_ids is not None and position_ids.dim() == 3 and a.get("attention_mask") is None and \
            "attention_mask" in _signature(type(self)).parameters:
        # the numbers of a mask of ones (one unpadded sample per row); transformers 4.53-4.57 crash building
        # the causal mask from 3-row ids without a mask (Qwen2-VL, GLM-4V), and 5.x would read the temporal
        # row as packed-sequence starts. With a KV cache (generate()), the mask covers the cached tokens too.
        cache = next((a[n] for n in _CACHE_NAMES if a.get(n) is not None), None)
        past = int(cache.get_seq_length()) if hasattr(cache, "get_seq_length") else 0
        changed["attention_mask"] = torch.ones((ref.shape[0], past + ref.shape[1]), dtype=torch.long,
                                               device=ref.device)
    if changed:
        a.update(changed)
        return _original(self, state, **a)
    return _original(self, state, *args, **kwargs)


def _packed(self, state, a, step, changed):
    """A packed step: upstream's call with no cache and a mask of ones, inside the step's scope (the rotary
    module hands the step to the layers on the position embeddings)."""
    import torch

    cache = next((a[n] for n in _CACHE_NAMES if a.get(n) is not None), None)
    if cache is not None:
        raise TfcompatError(
            f"tfcompat {state.family}: a packed row (or Ulysses shard) was passed with a KV cache "
            f"({type(cache).__name__}); sequences of a packed row cannot share one cache; pass use_cache=False "
            f"and no past_key_values for training, or unpack the row for generation"
        )
    if a.get("output_attentions"):
        raise TfcompatError(
            f"tfcompat {state.family}: output_attentions=True on a packed row (or Ulysses shard): the packed "
            f"attention computes no weight matrix; call the unpatched model on the padded batch to inspect weights"
        )
    ref = a.get("input_ids") if a.get("input_ids") is not None else a.get("inputs_embeds")
    if "use_cache" in _signature(type(self)).parameters or "use_cache" in a:
        changed["use_cache"] = False  # no cache for a packed row: the configs' default would create one
    if "attention_mask" in _signature(type(self)).parameters:
        # an explicit all-ones mask keeps upstream mask builders from re-reading packed position ids
        # (some releases cannot parse 3-row ids there); the patched attention does not use it
        changed["attention_mask"] = torch.ones(tuple(ref.shape[:2]), dtype=torch.long, device=ref.device)
    a.update(changed)
    with _carrier.carry(_carrier.Active(step)):
        return _original(self, state, **a)


def _top_forward(self, *args, **kwargs):
    """The model patch() was given: takes the flash-attn keyword arguments on every release and hands them to
    the text model of this call, out of upstream's call: 4.51-4.52 VL forwards reject them, and 5.x VL
    forwards pass ``**kwargs`` to the vision tower as well, whose flash attention names its own
    ``cu_seq_lens_q`` (the text row's would collide there)."""
    state = getattr(self, _ATTR)
    _refuse_whole_row_labels(state, kwargs)
    _packed_labels(state, kwargs)
    return _with_explicit(lambda *a, **k: _original(self, state, *a, **k), args, kwargs)


def _vl_top_forward(self, *args, **kwargs):
    """Both: the model patch() was given also owns the vision tower (4.51 ForConditionalGeneration)."""
    _refuse_whole_row_labels(getattr(self, _ATTR), kwargs)
    _packed_labels(getattr(self, _ATTR), kwargs)
    return _with_explicit(lambda *a, **k: _vl_forward(self, *a, **k), args, kwargs)


def _packed_labels(state, kwargs):
    """``labels`` of a packed row: upstream's shift makes each sequence's last token predict the next sequence's
    first, a target the padded batch does not have. Those targets are dropped (-100, out of place), as
    DataCollatorWithFlattening does; with ``num_items_in_batch`` (the Trainer's count of targets, taken from
    the same labels) the count would include them too: refused. One host sync per step with labels."""
    import torch

    labels = kwargs.get("labels")
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2 or labels.shape[0] != 1 or state.split():
        return
    starts = _boundaries.label_starts(kwargs, labels.shape[1])
    if not starts:
        return
    index = torch.tensor(starts, dtype=torch.long, device=labels.device)
    crossing = labels.index_select(1, index) != -100
    if not bool(crossing.any()):
        return
    if kwargs.get("num_items_in_batch") is not None:
        raise PackingError(
            f"tfcompat {state.family}: labels of a packed row hold targets at sequence starts "
            f"{[s for s, c in zip(starts, crossing[0].tolist()) if c]}: upstream's shift would make each "
            f"sequence's last token predict the next sequence's first, and num_items_in_batch counted those "
            f"targets; set labels to -100 at every sequence start before counting (DataCollatorWithFlattening "
            f"does), or pass no num_items_in_batch (tfcompat then drops those targets)")
    kwargs["labels"] = labels.index_fill(1, index, -100)


def _refuse_whole_row_labels(state, kwargs):
    if state.slice_inputs and state.split() and kwargs.get("labels") is not None:
        raise UlyssesError(
            f"tfcompat {state.family}: labels with slice_inputs=True: the model returns this rank's slice of the "
            f"logits, which upstream's loss cannot pair with the whole row's labels; call without labels and "
            f"compute the loss on the gathered logits (tfcompat.ulysses.gather_from_ranks), or on this rank's "
            f"slice of the shifted labels (tfcompat.ulysses.slice_for_rank)")


def _with_explicit(run, args, kwargs):
    explicit = {k: kwargs.pop(k) for k in _FLASH_KWARGS if k in kwargs}
    if not explicit:
        return run(*args, **kwargs)
    with _carrier.carry(_carrier.Named(explicit)):
        return run(*args, **kwargs)


def _vl_forward(self, *args, **kwargs):
    """The module that owns the vision tower.

    * Supplies ``mm_token_type_ids`` (from input_ids) where this release's forward takes it and the caller
      gave none: 5.3+ forwards need it to position image and video tokens.
    * On a text-only training batch, runs the tower on the smallest valid input and adds one zero-weighted
      scalar to the token embeddings (out of place), so every vision weight gets a zero gradient on every
      rank (DDP and FSDP stay in step); the numbers are unchanged.
    """
    import torch

    state = getattr(self, _ATTR)
    a = _arguments(self, args, kwargs)
    if a is None:
        return _original(self, state, *args, **kwargs)  # upstream says what is wrong with the call
    entry = _carrier.call_entry()
    ref = a.get("input_ids") if a.get("input_ids") is not None else a.get("inputs_embeds")
    if isinstance(entry, _carrier.Named) and torch.is_grad_enabled():
        _remember_explicit(ref, entry.kwargs)
    elif entry is None and (found := _recalled_explicit(ref)) is not None:
        with _carrier.carry(_carrier.Named(found)):  # a checkpoint's recomputation of this call: the same boundaries
            return _vl_forward(self, *args, **kwargs)
    pixels = a.get("pixel_values") is not None or a.get("pixel_values_videos") is not None
    decoding = any(a.get(n) is not None for n in _CACHE_NAMES) or \
        (a.get("cache_position") is not None and a.get("use_cache") is not False)
    if state.split() and not state.slice_inputs and not decoding:  # generate(): each rank its own prompts
        args, kwargs = (), _vl_shard(self, state, a, pixels)
    elif not pixels and a.get("position_ids") is None and _row_positions(state, a) is not None:
        args, kwargs = (), a
    if pixels and a.get("input_ids") is not None and a["input_ids"].shape[0] == 1 and \
            (not state.split() or state.slice_inputs):  # this rank holds the whole row
        explicit = _carrier.named() or {}
        _boundaries.check_vision_in_packed_row(self, state.family, a, explicit)
    if pixels and a.get("input_ids") is not None and a.get("mm_token_type_ids") is None and \
            "mm_token_type_ids" in _signature(type(self)).parameters:
        from ..embeds import mm_token_type_ids

        a["mm_token_type_ids"] = mm_token_type_ids(self.config, a["input_ids"])
        args, kwargs = (), a
    from ..embeds import dummy_audio_zero, dummy_visual_zero, has_audio_tower, tie_zero

    # every tower this batch does not feed runs on a dummy input (an omni thinker's audio tower on a batch
    # with images too): DDP/FSDP need the same parameters to get gradients on every rank
    audio = has_audio_tower(self) and a.get("input_features") is None
    if (pixels and not audio) or not state.dummy_visual or not (self.training and torch.is_grad_enabled()):
        return _original(self, state, *args, **kwargs)
    zero = dummy_visual_zero(self) if not pixels else None
    if audio:
        zero = dummy_audio_zero(self) if zero is None else zero + dummy_audio_zero(self)
    if a.get("inputs_embeds") is not None:
        a["inputs_embeds"] = tie_zero(a["inputs_embeds"], zero)
        return _original(self, state, **a)
    hook = self.get_input_embeddings().register_forward_hook(lambda m, i, out: tie_zero(out, zero))
    try:
        return _original(self, state, *args, **kwargs)
    finally:
        hook.remove()


def _row_positions(state, a):
    """A whole text-only VL row with boundaries (cu_seq_lens_q/k, tfcompat.packing.packed) and no position ids:
    upstream would count the mRoPE positions over the row as one sequence; they count from 0 in every sequence
    of the boundaries instead (3 equal rows, as for text tokens), set in ``a``. None where nothing is set."""
    explicit = _carrier.named() or {}
    ref = a.get("input_ids") if a.get("input_ids") is not None else a.get("inputs_embeds")
    cu = _boundaries.explicit_cu(explicit)
    if ref is None or cu is None or ref.shape[0] != 1 or cu.dim() != 1 or cu.numel() < 2 or \
            cu.dtype.is_floating_point or int(cu[-1]) != ref.shape[1]:
        return None  # not a whole packed row: the text model names what is wrong, if anything
    a["position_ids"] = _boundaries.positions_of(cu, ref.shape[1], ref.device)[None].expand(3, 1, -1)
    return a["position_ids"]


def _vl_shard(self, state, a, pixels):
    """This rank's slice of a VL row under a sequence-parallel group (the model was not told to slice): the
    vision tower cannot serve a slice, and upstream would count the mRoPE positions from the slice's first
    token; the positions come from the whole row's boundaries, or the call is refused."""
    if pixels:
        raise UlyssesError(
            f"tfcompat {state.family}: pixel values beside this rank's slice of the row under ulysses_group/"
            f"context_group: the vision tower's features cannot be matched to the image tokens of one slice; patch "
            f"with tfcompat.patch(model, ..., slice_inputs=True) and pass the whole row (ids, positions, pixels) on "
            f"every rank, or embed the whole row (tfcompat.embeds.get_input_embeds) and pass this rank's share to "
            f"the text model (tfcompat.ulysses.slice_inputs)")
    if a.get("position_ids") is None:
        explicit = _carrier.named() or {}
        ref = a.get("input_ids") if a.get("input_ids") is not None else a.get("inputs_embeds")
        if ref is not None:
            a["position_ids"] = _shards.shard_positions(state, explicit, None, ref.shape[1], ref.device, rows=3)
        if ref is not None and a["position_ids"] is None:
            raise UlyssesError(
                f"tfcompat {state.family}: this rank's slice of the row with no position ids: upstream would count "
                f"the mRoPE positions from the slice's first token; pass the whole row's positions "
                f"(tfcompat.embeds.rope_index, tfcompat.packing.pack) sliced with tfcompat.ulysses.slice_for_rank, "
                f"or the whole row's cu_seq_lens_q, or patch with slice_inputs=True and pass the whole row")
    return a


def _rotary_forward(self, *args, **kwargs):
    state = getattr(self, _ATTR)
    out = _original(self, state, *args, **kwargs)
    entry = _carrier.call_entry()
    if isinstance(entry, _carrier.Active) and isinstance(out, tuple):
        from .rotation import check_cos

        check_cos(state.family, *out)  # once per step: the per-layer rotation trusts this layout
        out = _Carried(out)
        out.step, out.rotations = entry.step, {}
    return out


def _carried(args, kwargs):
    """The step's carrier among a layer's arguments (keyword ``position_embeddings`` first), or None."""
    pe = kwargs.get("position_embeddings")
    if isinstance(pe, _Carried):
        return pe
    for v in args:
        if isinstance(v, _Carried):
            return v
    for v in kwargs.values():
        if isinstance(v, _Carried):
            return v
    return None


def _layer_forward(self, *args, **kwargs):
    state = getattr(self, _ATTR)
    pe = kwargs.get("position_embeddings")
    if not isinstance(pe, _Carried):
        pe = _carried(args, kwargs)
    if pe is None:
        if _in_step():
            raise TfcompatError(
                f"tfcompat {state.family}: {type(self).__name__} did not receive the position embeddings of this "
                f"packed step, so it cannot tell where sequences begin; a wrapper around the decoder layer that "
                f"drops keyword arguments would do this (wrap the layers with torch's checkpoint_wrapper or "
                f"tfcompat.enable_checkpointing); if nothing wraps it, this transformers release passes them "
                f"differently: please report it (transformers {_resolve._version.transformers_version()})")
        return _original(self, state, *args, **kwargs)
    if state.linear_child:
        args, kwargs = _with_step_mask(self, pe.step, args, kwargs)
    # the step rides in the call's own arguments (the position embeddings, the linear mixers' mask): whoever
    # checkpoints the layer (transformers' switch on any release, torch's wrappers) replays them as they are
    saved = state.saved_forward
    return saved(*args, **kwargs) if saved is not None else type(self).forward(self, *args, **kwargs)


def _with_step_mask(layer, step, args, kwargs):
    """The layer's call with ``attention_mask`` replaced by the step's boundaries (:class:`_StepMask`): the
    layer hands it to its mixer as is; the patched mixers read it (full attention ignores the mask in a
    packed step, and the all-ones mask the text model passed carries nothing)."""
    if "attention_mask" in kwargs:
        return args, {**kwargs, "attention_mask": _StepMask(step)}
    names = [n for n in _signature(type(layer)).parameters if n != "self"]
    if "attention_mask" in names and names.index("attention_mask") < len(args):
        i = names.index("attention_mask")
        return args[:i] + (_StepMask(step),) + args[i + 1:], kwargs
    return args, {**kwargs, "attention_mask": _StepMask(step)} if "attention_mask" in names else kwargs


def _in_step():
    """True inside a patched text model's packed step (this thread): a tripwire only, for a layer or mixer
    whose call lost the step's carrier; the step itself is never read from here below the rotary module."""
    return _carrier.in_step()


def _lost_step(state, module, what):
    return TfcompatError(
        f"tfcompat {state.family}: {type(module).__name__} was called in a packed step without {what} its decoder "
        f"layer passed (they carry the step's boundaries); something between the layer and the mixer rebuilt "
        f"them (a forward pre-hook or wrapper that copies or casts the arguments); pass them through unchanged, "
        f"or unpatch the model")


# ------------------------------------------------------------------------------- attention
def _attention_forward(self, *args, **kwargs):
    """Every layer of a packed step runs this: it reads its arguments, the step (on the position embeddings) and
    what patch time bound (``state``); the rotation is prepared once per step (:func:`.rotation.for_layers`)."""
    import torch

    state = getattr(self, _ATTR)
    pe = kwargs.get("position_embeddings")
    if not isinstance(pe, _Carried):
        pe = _carried(args, kwargs)
    hidden = args[0] if args else kwargs.get("hidden_states")
    if pe is None or hidden is None:
        return _attention_unpacked(self, state, args, kwargs)
    step = pe.step
    if hidden.shape[0] != 1:
        raise TfcompatError(f"tfcompat {state.family}: the packed attention needs batch 1, got batch "
                            f"{hidden.shape[0]}")
    if state.group_lost:
        state.group_or_raise()

    from .rotation import for_layers, rotate

    plan = state.plan  # the attention.signature plan, bound at patch time
    s, d = hidden.shape[1], self.head_dim
    q = self.q_proj(hidden)
    gate = None
    if plan.gated_query:  # Qwen3-Next, Qwen3.5: query and output gate interleaved per head (a probed fact)
        q, gate = torch.chunk(q.view(1, s, -1, 2 * d), 2, dim=-1)
        gate = gate.reshape(1, s, -1)
    q = q.view(1, s, -1, d)
    k = self.k_proj(hidden).view(1, s, -1, d)
    v = self.v_proj(hidden).view(1, s, -1, d)
    if getattr(self, "q_norm", None) is not None:
        q, k = self.q_norm(q), self.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    # out of place: a projection output (or a norm's) may be saved by selective activation checkpointing,
    # which a rotation in place would corrupt. cos/sin are this release's own (checked once per step).
    if torch.compiler.is_compiling():  # traced: the plain path, nothing kept between layers
        q, k = rotate(q, k, pe[0], pe[1], state.family, state.section, state.rope)
    else:
        rot = pe.rotations.get((q.dtype, q.shape, k.shape, q.stride(), k.stride()))
        if rot is None:
            rot = for_layers(pe, q, k, state.family, state.section, state.rope)
        q, k = rot(q, k)
    q, k, v = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0]
    dropout = self.attention_dropout if self.training else 0.0
    scale = getattr(self, "scaling", None) or d ** -0.5
    if state.group is not None or state.cgroup is not None:
        out = _attend_split(state, step, q, k, v, scale, dropout)
    else:
        out = _attend_row(step, q, k, v, scale, state.window, dropout)
    out = out.reshape(1, s, -1)
    if gate is not None:
        out = out * torch.sigmoid(gate)
    out = self.o_proj(out)
    return (out, None, None) if plan.returns == 3 else (out, None)


def _attend_row(step, q, k, v, scale, window, dropout):
    """Attention over the whole packed row this layer sees (after Ulysses: all of its heads' tokens)."""
    from ..varlen import _varlen

    if step.total != q.shape[0]:
        raise PackingError(f"tfcompat attention: boundaries cover {step.total} tokens but the layer sees "
                           f"{q.shape[0]}; pass boundaries of the whole (gathered) packed row")
    return _varlen(q, k, v, step.cu, step.bounds, step.max_len, causal=True, softmax_scale=scale, window=window,
                   dropout_p=dropout)


def _attend_split(state, step, q, k, v, scale, dropout):
    """Attention of this rank's slice: Ulysses all-to-all to whole-row heads, and/or context parallel chunks
    attending the whole row's K/V, then back to this rank's tokens."""
    group = state.group
    if group is not None:
        from ..ulysses import repeat_kv_for_group, to_heads

        # the step checked every rank's slice once (equal lengths); no check (host sync) per layer
        q = to_heads(q, group)
        k = to_heads(repeat_kv_for_group(k, state.world), group)
        v = to_heads(repeat_kv_for_group(v, state.world), group)
    if state.cgroup is not None:
        # context parallel: this rank's chunks (after Ulysses: of its heads) attend the whole row's K/V
        from .context import attend, pieces

        if "context" not in step.memo:  # once per step: Python ints only
            import torch.distributed as dist

            step.memo["context"] = pieces(step, dist.get_rank(state.cgroup), state.cworld, q.shape[0])
        out = attend(q, k, v, step, step.memo["context"], state.cgroup, scale=scale, window=state.window,
                     dropout_p=dropout)
    else:
        out = _attend_row(step, q, k, v, scale, state.window, dropout)
    if group is not None:
        from ..ulysses import to_sequence

        out = to_sequence(out, group)
    return out


def _attention_unpacked(self, state, args, kwargs):
    """Not a packed step: upstream's attention, unchanged (a sequence-parallel one only inside a step)."""
    if _in_step():
        raise _lost_step(state, self, "the position embeddings")
    if state.split() or state.group_lost:
        a = _arguments(self, args, kwargs)
        if a is not None and not any(a.get(n) is not None for n in _CACHE_NAMES):
            raise UlyssesError(f"tfcompat {state.family}: a Ulysses- or context-parallel-patched attention was "
                               f"called outside a patched text model step; call the model (or its text model), "
                               f"not the layer")
    return _original(self, state, *args, **kwargs)  # not packed: upstream, unchanged


# ------------------------------------------------------------------------ linear attention
def _linear_forward(self, hidden_states, *args, **kwargs):
    import torch

    state = getattr(self, _ATTR)
    carrier = next((v for v in (*args, *kwargs.values()) if isinstance(v, _StepMask)), None)
    step = carrier.step if carrier is not None else None
    if step is None:
        if _in_step():
            raise _lost_step(state, self, "the attention mask")
        return _original(self, state, hidden_states, *args, **kwargs)
    args = tuple(None if v is carrier else v for v in args)
    cache = next((kwargs[n] for n in _CACHE_NAMES if kwargs.get(n) is not None), args[0] if args else None)
    if cache is not None or hidden_states.shape[0] != 1:
        raise TfcompatError(f"tfcompat {state.family}: the packed linear attention takes batch 1 and no cache")
    kwargs = {k: v for k, v in kwargs.items() if k not in _FLASH_KWARGS + ("position_ids", "attention_mask")}
    # The torch fallback of transformers ignores cu_seqlens, so run each sequence on its own:
    # exact, and no recurrent or convolution state crosses a boundary.
    b = step.bounds
    outs = [_original(self, state, hidden_states[:, lo:hi], *args, **kwargs) for lo, hi in zip(b[:-1], b[1:])]
    return torch.cat(outs, dim=1)


FORWARDS = {"vl+top": _vl_top_forward, "vl": _vl_forward, "top": _top_forward, "text": _text_model_forward,
             "rotary": _rotary_forward, "layer": _layer_forward,
             "attention": _attention_forward, "linear": _linear_forward}


