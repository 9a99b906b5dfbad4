"""The forwards above the text model: the model ``patch()`` was given (takes the flash-attn keyword arguments on
every release and hands them to its text model through the carrier; packed labels) and the module owning the
vision tower (mm_token_type_ids, the vision checks of a packed row, sequence-parallel slices of a VL row, the
dummy tower run on text-only batches). Installed by reference, as :mod:`.forwards`.
"""

from __future__ import annotations

from .._attention import boundaries as _boundaries
from .._parallel import shards as _shards
from ..errors import PackingError, UlyssesError
from . import labels as _labels
from . import scope as _scope
from .install import (
    _ATTR,
    _FLASH_KWARGS,
    _arguments,
    _original,
    _recalled_explicit,
    _remember_explicit,
    _signature,
    decoding,
)


def top_forward(self, *args, **kwargs):
    """The model patch() was given: takes the flash-attn keyword arguments on every release and hands them to
    the text model of this call, out of upstream's call: 4.51-4.52 VL forwards reject them, and 5.x VL
    forwards pass ``**kwargs`` to the vision tower as well, whose flash attention names its own
    ``cu_seq_lens_q`` (the text row's would collide there)."""
    state = getattr(self, _ATTR)
    _labels.refuse_whole_row_labels(state, kwargs)
    _labels.packed_labels(state, kwargs)
    return _with_explicit(lambda *given, **k: _original(self, state, *given, **k), args, kwargs)


def vl_top_forward(self, *args, **kwargs):
    """Both: the model patch() was given also owns the vision tower (4.51 ForConditionalGeneration)."""
    _labels.refuse_whole_row_labels(getattr(self, _ATTR), kwargs)
    _labels.packed_labels(getattr(self, _ATTR), kwargs)
    return _with_explicit(lambda *given, **k: vl_forward(self, *given, **k), args, kwargs)


def _traced_tower_zero(owner, state, vision, audio):
    """Inside a region torch.compile traces: the towers' zero term from their weights (each weighted by 0,
    summed in fp32), not from a dummy input, whose grid upstream's towers read back to the host (a graph break,
    or no graph under ``fullgraph=True``). Every weight gets a zero gradient, as DDP needs; the numbers are
    unchanged. A tower whose weights are sharded (FSDP2, DeepSpeed ZeRO-3) must run its forward on every rank
    for its gathers to pair: refused, with what to do instead."""
    import torch

    towers = ([owner.visual] if vision else []) + ([owner.audio_tower] if audio else [])
    for tower in towers:
        sharded = any(type(m).__name__.startswith("FSDP") for m in tower.modules()) or \
            any(hasattr(p, "ds_id") for p in tower.parameters())
        if sharded:
            raise PackingError(
                f"tfcompat {state.family}: a text-only batch inside a region torch.compile traces, with the vision "
                f"or audio tower's weights sharded (FSDP2 / ZeRO-3): the tower must run on every rank for its "
                f"gathers to pair, and upstream's tower cannot be traced; compile the decoder layers instead "
                f"(layer.compile()), or patch with dummy_visual=False if every rank's batches have the same kind")
    zero = torch.zeros((), dtype=torch.float32, device=next(towers[0].parameters()).device)
    for tower in towers:
        for p in tower.parameters():
            if p.requires_grad:
                zero = zero + (p.float() * 0.0).sum()
    return zero


def _with_explicit(run, args, kwargs):
    explicit = {k: kwargs.pop(k) for k in _FLASH_KWARGS if k in kwargs}
    if not explicit:
        return run(*args, **kwargs)
    with _scope.carry(_scope.CallBoundaries(explicit)):
        return run(*args, **kwargs)


def vl_forward(self, *args, **kwargs):
    """The module that owns the vision tower.

    * Supplies ``mm_token_type_ids`` (from input_ids) where this release's forward takes it and the caller
      gave none: 5.3+ forwards need it to position image and video tokens.
    * On a text-only training batch, runs the tower on the smallest valid input and adds one zero-weighted
      scalar to the token embeddings (out of place), so every vision weight gets a zero gradient on every
      rank (DDP and FSDP stay in step); the numbers are unchanged.
    """
    import torch

    state = getattr(self, _ATTR)
    given = _arguments(self, args, kwargs)
    if given is None:
        return _original(self, state, *args, **kwargs)  # upstream says what is wrong with the call
    entry = _scope.call_entry()
    inputs = given.get("input_ids") if given.get("input_ids") is not None else given.get("inputs_embeds")
    if isinstance(entry, _scope.CallBoundaries) and torch.is_grad_enabled():
        _remember_explicit(state, inputs, entry.kwargs)
    elif entry is None and (found := _recalled_explicit(state, inputs)) is not None:
        with _scope.carry(_scope.CallBoundaries(found)):  # a checkpoint recomputing this call: same boundaries
            return vl_forward(self, *args, **kwargs)
    pixels = given.get("pixel_values") is not None or given.get("pixel_values_videos") is not None
    is_decoding = decoding(given)
    if state.split() and not state.slice_inputs and not is_decoding:  # generate(): each rank its own prompts
        args, kwargs = (), _vl_shard(self, state, given, pixels)
    elif not pixels and given.get("position_ids") is None and _row_positions(state, given) is not None:
        args, kwargs = (), given
    elif not pixels and not is_decoding and given.get("position_ids") is None and given.get("input_ids") is None and \
            given.get("attention_mask") is None and given.get("inputs_embeds") is not None:
        # text embeddings alone: the positions count over the row, as upstream counts them from input_ids (the
        # releases up to 5.0 read input_ids' shape for them and fail on embeddings alone)
        embeds = given["inputs_embeds"]
        given["position_ids"] = torch.arange(embeds.shape[1], device=embeds.device).expand(3, embeds.shape[0], -1)
        args, kwargs = (), given
    if pixels and given.get("input_ids") is not None and given["input_ids"].shape[0] == 1 and \
            (not state.split() or state.slice_inputs):  # this rank holds the whole row
        explicit = _scope.named() or {}
        check_vision_in_packed_row(self, state.family, given, explicit)
    if pixels and given.get("input_ids") is not None and given.get("mm_token_type_ids") is None and \
            "mm_token_type_ids" in _signature(type(self)).parameters:
        from .tokens import mm_token_type_ids

        given["mm_token_type_ids"] = mm_token_type_ids(self.config, given["input_ids"])
        args, kwargs = (), given
    return _with_unfed_towers(self, state, given, args, kwargs, pixels)


def _with_unfed_towers(self, state, given, args, kwargs, pixels):
    """Upstream's call, with every tower this batch does not feed run on a dummy input and tied to the embeddings by
    a zero (an omni thinker's audio tower on a batch with images too): DDP/FSDP need the same parameters to get
    gradients on every rank. Only in training with ``dummy_visual``."""
    import torch

    from .dummy import dummy_audio_zero, dummy_visual_zero, has_audio_tower, tie_zero

    audio = has_audio_tower(self) and given.get("input_features") is None
    if (pixels and not audio) or not state.dummy_visual or not (self.training and torch.is_grad_enabled()):
        return _original(self, state, *args, **kwargs)
    if torch.compiler.is_compiling():
        zero = _traced_tower_zero(self, state, vision=not pixels, audio=audio)
    else:
        zero = dummy_visual_zero(self) if not pixels else None
        if audio:
            zero = dummy_audio_zero(self) if zero is None else zero + dummy_audio_zero(self)
    if given.get("inputs_embeds") is not None:
        given["inputs_embeds"] = tie_zero(given["inputs_embeds"], zero)
        return _original(self, state, **given)
    if torch.compiler.is_compiling():  # the patched text model adds it to the embeddings it is handed
        with _scope.carry(_scope.TowersZero(zero)):
            return _original(self, state, *args, **kwargs)
    hook = self.get_input_embeddings().register_forward_hook(lambda m, i, out: tie_zero(out, zero))
    try:
        return _original(self, state, *args, **kwargs)
    finally:
        hook.remove()


def _row_positions(state, given):
    """A whole text-only VL row with boundaries (cu_seq_lens_q/k, seq_idx, tfcompat.packing.packed) and no position ids:
    upstream would count the mRoPE positions over the row as one sequence; they count from 0 in every sequence
    of the boundaries instead (3 equal rows, as for text tokens), set in ``given``. None where nothing is set."""
    explicit = _scope.named() or {}
    inputs = given.get("input_ids") if given.get("input_ids") is not None else given.get("inputs_embeds")
    cu = _boundaries.explicit_cu(explicit)
    seq_idx = explicit.get("seq_idx")
    if cu is None and inputs is not None and getattr(seq_idx, "shape", None) == (1, inputs.shape[1]):
        cu = _boundaries.cu_from_seq_idx(seq_idx, 1, inputs.shape[1])  # DataCollatorWithFlattening(return_seq_idx)
    if inputs is None or cu is None or inputs.shape[0] != 1 or cu.dim() != 1 or cu.numel() < 2 or \
            cu.dtype.is_floating_point:
        return None  # not a whole packed row: the text model names what is wrong, if anything
    import torch

    # eagerly a row the boundaries do not cover is left to the text model's refusal; traced, no host read: the
    # text model's traced step checks the boundaries against the row inside the graph
    if not torch.compiler.is_compiling() and int(cu[-1]) != inputs.shape[1]:
        return None
    given["position_ids"] = _boundaries.positions_of(cu, inputs.shape[1], inputs.device)[None].expand(3, 1, -1)
    return given["position_ids"]


def _vl_shard(self, state, given, pixels):
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
    if given.get("position_ids") is None:
        explicit = _scope.named() or {}
        inputs = given.get("input_ids") if given.get("input_ids") is not None else given.get("inputs_embeds")
        if inputs is not None:
            given["position_ids"] = _shards.shard_positions(state, explicit, None, inputs.shape[1], inputs.device,
                                                            rows=3)
        if inputs is not None and given["position_ids"] is None:
            raise UlyssesError(
                f"tfcompat {state.family}: this rank's slice of the row with no position ids: upstream would count "
                f"the mRoPE positions from the slice's first token; pass the whole row's positions "
                f"(tfcompat.embeds.rope_index, tfcompat.packing.pack) sliced with tfcompat.ulysses.slice_for_rank, "
                f"or the whole row's cu_seq_lens_q, or patch with slice_inputs=True and pass the whole row")
    return given


# --------------------------------------------------------------- checks of the top call's inputs
def check_vision_in_packed_row(owner, family, given, explicit):
    """A packed row with images or videos (one host sync per step): its sequence starts must not fall inside
    a run of placeholder tokens, and 2-D (text) position ids would give the vision tokens text positions."""
    import torch

    from .tokens import mm_token_type_ids

    ids = given["input_ids"]
    explicit = dict(explicit, **{k: given[k] for k in _FLASH_KWARGS if given.get(k) is not None})
    position_ids = given.get("position_ids")
    text = _boundaries.text_row(position_ids)
    cu = explicit.get("cu_seq_lens_q", explicit.get("cu_seq_lens_k"))
    packed = _scope.packed_boundaries()  # read by this copy's patched model, whichever boundaries win
    if cu is None and packed is not None:
        cu = packed.cu
    n = ids.shape[-1]
    if isinstance(cu, torch.Tensor) and cu.device.type != "meta" and cu.dim() == 1:
        inner = cu[1:-1].to(device=ids.device, dtype=torch.long)
        slot = torch.where((inner > 0) & (inner < n), inner, n)  # a boundary outside the row: the spare slot n
        start = torch.zeros(n + 1, dtype=torch.bool, device=ids.device).index_fill(0, slot, True)[:n]
    elif text is not None:
        valid = _boundaries.mask_valid(given.get("attention_mask"), n)
        if isinstance(valid, str):
            return  # a 4-D mask (or a cache's longer one) says itself what attends: upstream's own path
        if valid is not None:  # one prompt with padding (generate(), assisted decoding): not a packed row
            if len(_boundaries.padded_starts(text[0], valid)) > 1:
                raise PackingError(f"tfcompat {family}: the position ids restart at 0 (a packed row) but "
                                   f"attention_mask has padding in the row; drop the padding "
                                   f"(tfcompat.packing.pack does) or pass no mask")
            return
        start = torch.cat((text[0][:1] != text[0][:1], text[0][1:] == 0))  # a sequence begins at position 0
    else:
        return
    vision = mm_token_type_ids(owner.config, ids)[0] != 0
    inside = start & vision & torch.cat((vision[:1] & False, vision[:-1]))
    # one host sync for the whole check: whether the row restarts anywhere, and the first start inside a run
    # of placeholder tokens (-1: none)
    restarts, first = torch.stack((start.any().long(), torch.where(inside.any(), inside.long().argmax(), -1))).tolist()
    if position_ids is not None and position_ids.dim() == 2 and restarts:
        raise PackingError(
            f"tfcompat {family}: a packed row with images or videos and 2-D position ids: the vision tokens "
            f"would get text positions; pass the mRoPE ids (tfcompat.embeds.rope_index) to "
            f"tfcompat.packing.pack(..., config=model.config), which builds 4-row ids")
    if first >= 0:
        raise PackingError(
            f"tfcompat {family}: a sequence of the packed row starts at token {first}, inside the "
            f"placeholder tokens of an image or video; every image and video must lie within one sequence; "
            f"check the boundaries (cu_seq_lens_q or the text row of the position ids)")


_GENERATION_HOOK = "_prepare_position_ids_for_generation"


def install_generation_positions(model, family):
    """5.x generate() places vision tokens before any forward runs: the VL classes' override of
    ``_prepare_position_ids_for_generation`` reads ``mm_token_type_ids`` from generate's keyword arguments, and
    without them sets ``rope_deltas`` to 0, so every decoding step runs on text positions (5.16+). Callers written
    for 4.x (and the forward tfcompat patches, which supplies them) pass none. On the patched model that override
    gets them from ``input_ids`` first, in generate's own keyword arguments, so every later step (cache updates,
    beam search, prompt lookup, assisted decoding) sees what the processor would have returned. Set
    on the instance (a deep copy binds its own). Returns whether it was installed."""
    hook = getattr(type(model), _GENERATION_HOOK, None)
    if hook is None or not family.vision or "mm_token_type_ids" not in _signature(type(model)).parameters:
        return False
    if "model_kwargs" not in _signature_of(hook):
        return False  # another shape of the hook than the one read here: upstream's own, unchanged
    model.__dict__[_GENERATION_HOOK] = _GenerationPositions(model)
    return True


class _GenerationPositions:
    """The instance's ``_prepare_position_ids_for_generation``: picklable and deep-copyable (a copy holds the
    copied model), as the patched forwards are."""

    def __init__(self, model):
        self.model = model

    def __call__(self, inputs_tensor, model_kwargs):
        return _generation_positions(self.model, inputs_tensor, model_kwargs)


def uninstall_generation_positions(model):
    model.__dict__.pop(_GENERATION_HOOK, None)


def _signature_of(fn):
    import inspect

    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}


def _generation_positions(self, inputs_tensor, model_kwargs):
    import torch

    ids = model_kwargs.get("input_ids")
    if not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] > 0):
        ids = inputs_tensor
    grids = model_kwargs.get("image_grid_thw") is not None or model_kwargs.get("video_grid_thw") is not None
    if grids and model_kwargs.get("mm_token_type_ids") is None and isinstance(ids, torch.Tensor) and \
            ids.dim() == 2 and not ids.is_floating_point():
        from .tokens import mm_token_type_ids

        model_kwargs["mm_token_type_ids"] = mm_token_type_ids(self.config, ids)
    return getattr(type(self), _GENERATION_HOOK)(self, inputs_tensor, model_kwargs)
