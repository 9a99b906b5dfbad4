"""tfcompat.patch / tfcompat.unpatch: packed-sequence and Ulysses attention for GLM/Qwen models.

What gets patched, on the model *instance* (never the class, so two models in one process
do not interfere):

* the text decoder stack's forward: decides once per step whether the row is packed and
  where its sequences begin (see "boundaries" below), checks what the packed path cannot
  serve, and on releases whose text model predates 4-row position ids strips the text row;
* its rotary module: in a packed step, the ``(cos, sin)`` it returns is a tuple that also
  carries the step's boundaries (:class:`_Carried`). Decoder layers hand that tuple down
  unchanged, and activation-checkpoint recomputation replays the layer call with the same
  tuple, so boundaries travel *with the call*, never through state recomputation cannot see;
* every decoder layer: reads the boundaries from its arguments and scopes them to its own
  call (first pass and recomputation alike), for the layers below it; a layer that holds a
  linear-attention mixer hands them to it as its ``attention_mask`` (:class:`_StepMask`), so a
  checkpoint wrapper around the mixer alone replays them too;
* every text attention module: projections, q/k norms, Qwen3.5's gated query, RoPE out of place
  through :func:`tfcompat.rope.rotate` (nothing autograd may have saved is written), Ulysses all-to-all,
  :func:`~tfcompat.varlen.varlen_attention`, output projection, in this release's arity;
* Qwen3.5's Gated DeltaNet layers: run per packed sequence, so no recurrent state leaks.

Boundaries, explicit first: ``cu_seq_lens_q`` (+ ``max_length_q``) keyword arguments (what
transformers' flattening collator produces), :func:`tfcompat.packing.packed`, the text row of
4-row position ids, 2-D text ids where a sequence starts at position 0 (transformers' own
rule). An mRoPE temporal row is never read as boundaries. Each source is validated once per
step (``_boundaries``); the per-layer code does no host sync.

Fail closed: a packed row (or any Ulysses step) either runs the patched path or raises a
:class:`~tfcompat.errors.TfcompatError`; nothing that could be packed is handed to upstream.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import threading
from typing import TYPE_CHECKING, Any

from . import _boundaries, _resolve
from ._families import family as _family
from .errors import ModelError, PackingError, TfcompatError, UlyssesError, UnsupportedTransformersError

if TYPE_CHECKING:
    import torch

__all__ = ["patch", "unpatch", "PatchRecord"]

_ATTR = "_tfcompat_patch"          # per patched module: its _State
_MODEL_ATTR = "_tfcompat_model"    # per model passed to patch(): its record
_FLASH_KWARGS = _boundaries.FLASH_KWARGS
_CACHE_NAMES = ("cache", "past_key_values", "past_key_value", "cache_params")


@dataclasses.dataclass(frozen=True)
class PatchRecord:
    """What :func:`patch` did: the modules patched now, and the decisions it used.

    .. versionadded:: 0.1.0
    """

    family: str
    text_model: str
    attention_modules: int
    linear_attention_modules: int
    remove_padding: bool
    ulysses_world_size: int
    resolutions: tuple
    #: each patched attention layer's sliding window (None: every key), as upstream decides it for this model
    #: (tfcompat._window: probed per layer), and how it was decided
    windows: tuple = ()
    windows_how: str = ""


class _State:
    """Per patched module. Picklable and deep-copyable: a copy shares the (unpicklable) process group;
    a pickled copy forgets it and asks to be patched again before a Ulysses step."""

    def __init__(self, kind, family, remove_padding, group, world, saved_forward=None, dummy_visual=True,
                 slice_inputs=False):
        self.kind, self.family, self.remove_padding = kind, family, remove_padding
        self.slice_inputs = slice_inputs  # Ulysses: every rank passes the whole row; the text model slices it
        self.dummy_visual = dummy_visual
        self.section = None  # attention modules: mRoPE sections, read from the config once at patch time
        self.window = None  # attention modules: the sliding window upstream uses on this layer (patch time)
        self.group, self.world, self.saved_forward = group, world, saved_forward
        self.group_lost = False
        self.linear_child = False  # decoder layers: holds a linear-attention mixer (gets a _StepMask)

    def __deepcopy__(self, memo):
        new = copy.copy(self)
        new.saved_forward = copy.deepcopy(self.saved_forward, memo)
        return new

    def __getstate__(self):
        state = dict(self.__dict__)
        if state["group"] is not None:
            state["group"], state["group_lost"] = None, True
        return state

    def group_or_raise(self):
        if self.group_lost:
            raise UlyssesError(
                f"tfcompat: this {self.family} model was patched for Ulysses and then pickled or saved; a process "
                f"group cannot travel with it; call tfcompat.patch(model, ulysses_group=group) again after loading"
            )
        return self.group


class _PatchedForward:
    """What a patched module's ``forward`` is: a picklable callable bound to its module."""

    def __init__(self, module, kind):
        self.module, self.kind = module, kind

    def __call__(self, *args, **kwargs):
        return _FORWARDS[self.kind](self.module, *args, **kwargs)

    @property
    def __signature__(self):
        """The signature of the forward this one replaced: HF Trainer filters batch columns by it, and
        generate() validates its keyword arguments and builds its inputs by it."""
        state = self.module.__dict__.get(_ATTR)
        saved = getattr(state, "saved_forward", None)
        original = saved if saved is not None else type(self.module).forward.__get__(self.module)
        return inspect.signature(original)

    def __repr__(self):
        return f"<tfcompat patched {self.kind} forward of {type(self.module).__name__}>"


class _Carried(tuple):
    """``(cos, sin)`` that also carries the step's boundaries down to the layers."""

    step = None


class _StepMask:
    """What a decoder layer that holds a linear-attention mixer passes as ``attention_mask`` in a packed step:
    the step's boundaries, handed to the mixer through its own call, so a checkpoint wrapper around the mixer
    alone replays the call with them (the full-attention mixers get theirs through ``_Carried``)."""

    def __init__(self, step):
        self.step = step

    def __repr__(self):
        return f"<tfcompat packed-step boundaries {list(self.step.bounds)}>"


_scope = threading.local()


def _scoped():
    stack = getattr(_scope, "stack", None)
    return stack[-1] if stack else None


class _Scope:
    def __init__(self, value):
        self.value = value

    def __enter__(self):
        stack = getattr(_scope, "stack", None)
        if stack is None:
            stack = _scope.stack = []
        stack.append(self.value)

    def __exit__(self, *exc):
        _scope.stack.pop()


# ----------------------------------------------------------------------------------- helpers
def _original(module, state, *args, **kwargs):
    if state.saved_forward is not None:
        return state.saved_forward(*args, **kwargs)
    return type(module).forward(module, *args, **kwargs)


_SIGNATURES: dict = {}


def _signature(cls):
    sig = _SIGNATURES.get(cls)
    if sig is None:
        sig = _SIGNATURES[cls] = inspect.signature(inspect.unwrap(cls.forward))
    return sig


def _arguments(module, args, kwargs):
    sig = _signature(type(module))
    try:
        bound = sig.bind(module, *args, **kwargs)
    except TypeError:
        return None
    out = dict(bound.arguments)
    out.pop("self", None)
    for name, value in list(out.items()):
        if sig.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            out.pop(name)
            out.update(value)
    return out


# ------------------------------------------------------------------------------ text model
def _text_model_forward(self, *args, **kwargs):
    import torch

    state = getattr(self, _ATTR)
    explicit = {k: kwargs.pop(k) for k in _FLASH_KWARGS if k in kwargs}
    scope = _scoped()
    if not explicit and scope is not None and scope[0] == "explicit":
        explicit = scope[1]
    a = _arguments(self, args, kwargs)
    if a is None:
        return _original(self, state, *args, **kwargs)  # upstream says what is wrong with the call
    plan = _resolve.resolve("attention.signature", state.family).plan
    group = state.group_or_raise()
    ref = a.get("input_ids") if a.get("input_ids") is not None else a.get("inputs_embeds")
    if ref is None:
        return _original(self, state, *args, **kwargs)
    _boundaries.check_position_shape(state.family, a.get("position_ids"), ref.shape[0], ref.shape[1])
    if group is not None and state.slice_inputs:
        a = _boundaries.slice_whole_row(self, state, a, explicit, group)
        ref = a["inputs_embeds"]
    elif group is not None:
        _boundaries.check_ulysses_lengths(ref.shape[1], ref.shape[0], group, state, ref, a.get("position_ids"))
    position_ids = a.get("position_ids")
    batch, local = ref.shape[0], ref.shape[1]
    changed = {}
    if position_ids is not None and position_ids.dim() == 3 and position_ids.shape[0] == 4 and not plan.four_row_ids:
        changed["position_ids"] = position_ids[1:]  # this release's text model predates the 4-row layout

    step = _boundaries.find_step(state, group, explicit, position_ids, a.get("attention_mask"), batch, local,
                                 ref.device)
    if step is None:
        if position_ids is not None and position_ids.dim() == 3 and a.get("attention_mask") is None and \
                "attention_mask" in _signature(type(self)).parameters:
            # the numbers of a mask of ones (one unpadded sample per row); transformers 4.53-4.57 crash building
            # the causal mask from 3-row ids without a mask (Qwen2-VL, GLM-4V), and 5.x would read the temporal
            # row as packed-sequence starts. With a KV cache (generate()), the mask covers the cached tokens too.
            cache = next((a[n] for n in _CACHE_NAMES if a.get(n) is not None), None)
            past = int(cache.get_seq_length()) if hasattr(cache, "get_seq_length") else 0
            changed["attention_mask"] = torch.ones((batch, past + local), dtype=torch.long, device=ref.device)
        if changed:
            a.update(changed)
            return _original(self, state, **a)
        return _original(self, state, *args, **kwargs)

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
    if "use_cache" in _signature(type(self)).parameters or "use_cache" in a:
        changed["use_cache"] = False  # no cache for a packed row: the configs' default would create one
    if "attention_mask" in _signature(type(self)).parameters:
        # an explicit all-ones mask keeps upstream mask builders from re-reading packed position ids
        # (some releases cannot parse 3-row ids there); the patched attention does not use it
        changed["attention_mask"] = torch.ones((batch, local), dtype=torch.long, device=ref.device)
    a.update(changed)
    with _Scope(("step", step)):
        return _original(self, state, **a)


def _top_forward(self, *args, **kwargs):
    """The model patch() was given: takes the flash-attn keyword arguments on every release (some top-level
    forwards reject them) and hands them to the text model of this call."""
    state = getattr(self, _ATTR)
    _refuse_whole_row_labels(state, kwargs)
    return _with_explicit(lambda *a, **k: _original(self, state, *a, **k), args, kwargs)


def _vl_top_forward(self, *args, **kwargs):
    """Both: the model patch() was given also owns the vision tower (4.51 ForConditionalGeneration)."""
    _refuse_whole_row_labels(getattr(self, _ATTR), kwargs)
    return _with_explicit(lambda *a, **k: _vl_forward(self, *a, **k), args, kwargs)


def _refuse_whole_row_labels(state, kwargs):
    if state.slice_inputs and state.group is not None and kwargs.get("labels") is not None:
        raise UlyssesError(
            f"tfcompat {state.family}: labels with slice_inputs=True: the model returns this rank's slice of the "
            f"logits, which upstream's loss cannot pair with the whole row's labels; call without labels and "
            f"compute the loss on the gathered logits (tfcompat.ulysses.gather_from_ranks), or on this rank's "
            f"slice of the shifted labels (tfcompat.ulysses.slice_for_rank)")


def _with_explicit(run, args, kwargs):
    explicit = {k: kwargs.pop(k) for k in _FLASH_KWARGS if k in kwargs}
    if not explicit:
        return run(*args, **kwargs)
    with _Scope(("explicit", explicit)):
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
    pixels = a.get("pixel_values") is not None or a.get("pixel_values_videos") is not None
    if pixels and a.get("input_ids") is not None and a["input_ids"].shape[0] == 1 and \
            (state.group is None or state.slice_inputs):  # this rank holds the whole row
        scope = _scoped()
        explicit = scope[1] if scope is not None and scope[0] == "explicit" else {}
        _boundaries.check_vision_in_packed_row(self, state.family, a, explicit)
    if pixels and a.get("input_ids") is not None and a.get("mm_token_type_ids") is None and \
            "mm_token_type_ids" in _signature(type(self)).parameters:
        from .embeds import mm_token_type_ids

        a["mm_token_type_ids"] = mm_token_type_ids(self.config, a["input_ids"])
        args, kwargs = (), a
    from .embeds import dummy_audio_zero, dummy_visual_zero, has_audio_tower, tie_zero

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


def _rotary_forward(self, *args, **kwargs):
    state = getattr(self, _ATTR)
    out = _original(self, state, *args, **kwargs)
    scope = _scoped()
    if scope is not None and scope[0] == "step" and isinstance(out, tuple):
        from .rope import check_cos

        check_cos(state.family, *out)  # once per step: the per-layer rotation trusts this layout
        out = _Carried(out)
        out.step = scope[1]
    return out


def _layer_forward(self, *args, **kwargs):
    state = getattr(self, _ATTR)
    step = next((v.step for v in (*args, *kwargs.values()) if isinstance(v, _Carried)), None)
    if step is None:
        scope = _scoped()
        if scope is not None and scope[0] == "step":
            raise TfcompatError(
                f"tfcompat {state.family}: {type(self).__name__} did not receive the position embeddings of this "
                f"packed step, so it cannot tell where sequences begin; a wrapper around the decoder layer that "
                f"drops keyword arguments would do this (wrap the layers with torch's checkpoint_wrapper or "
                f"tfcompat.enable_checkpointing); if nothing wraps it, this transformers release passes them "
                f"differently: please report it (transformers {_resolve._version.transformers_version()})")
        return _original(self, state, *args, **kwargs)
    if getattr(state, "linear_child", False):
        args, kwargs = _with_step_mask(self, step, args, kwargs)
    raw = _checkpointed_forward(self, state)
    if raw is not None:
        # transformers checkpoints the class forward itself (5.2x GradientCheckpointingLayer wraps
        # ``cls.forward``), so its recomputation would run below this scope; checkpoint here instead, with
        # the scope inside the recomputed function (a packed step has no cache to flip off)
        import functools

        def scoped(*a, **k):
            with _Scope(("layer", step)):
                return raw(self, *a, **k)

        return self._gradient_checkpointing_func(functools.partial(scoped, **kwargs), *args)
    with _Scope(("layer", step)):
        return _original(self, state, *args, **kwargs)


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


def _checkpointed_forward(module, state):
    """The function below transformers' per-class checkpoint wrapper when it would checkpoint now, else None."""
    import torch

    if state.saved_forward is not None or not (getattr(module, "gradient_checkpointing", False) and module.training
                                               and torch.is_grad_enabled()):
        return None
    fwd = type(module).forward
    code = getattr(fwd, "__code__", None)
    if code is None or code.co_name != "forward_with_checkpointing" or not hasattr(fwd, "__wrapped__"):
        return None
    return fwd.__wrapped__


def _layer_step(module, position_embeddings=None):
    if isinstance(position_embeddings, _Carried):
        return position_embeddings.step
    scope = _scoped()
    return scope[1] if scope is not None and scope[0] == "layer" else None


# ------------------------------------------------------------------------------- attention
def _attention_forward(self, *args, **kwargs):
    import torch

    state = getattr(self, _ATTR)
    a = _arguments(self, args, kwargs)
    if a is None:
        return _original(self, state, *args, **kwargs)
    pe = a.get("position_embeddings")
    step = _layer_step(self, pe)
    if step is None:
        if state.group is not None or state.group_lost:
            raise UlyssesError(f"tfcompat {state.family}: a Ulysses-patched attention was called outside a patched "
                               f"text model step; call the model (or its text model), not the layer")
        return _original(self, state, *args, **kwargs)  # not packed: upstream, unchanged
    hidden = a["hidden_states"]
    if pe is None or hidden.shape[0] != 1:
        raise TfcompatError(f"tfcompat {state.family}: the packed attention needs position_embeddings and batch 1, "
                            f"got {'no position embeddings' if pe is None else f'batch {hidden.shape[0]}'}")
    group = state.group_or_raise()

    from .rope import rotate
    from .varlen import _varlen

    plan = _resolve.resolve("attention.signature", state.family).plan
    _, s, _ = hidden.shape
    d = self.head_dim
    q = self.q_proj(hidden)
    gate = None
    if q.shape[-1] == 2 * _heads(self) * d:  # Qwen3.5: query and output gate interleaved per head
        q, gate = torch.chunk(q.view(1, s, -1, 2 * d), 2, dim=-1)
        gate = gate.reshape(1, s, -1)
    q = q.view(1, s, -1, d)
    k = self.k_proj(hidden).view(1, s, -1, d)
    v = self.v_proj(hidden).view(1, s, -1, d)
    if getattr(self, "q_norm", None) is not None:
        q, k = self.q_norm(q), self.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = pe
    # out of place: a projection output (or a norm's) may be saved by selective activation checkpointing,
    # which a rotation in place would corrupt. cos/sin are this release's own (checked once per step).
    q, k = rotate(q, k, cos, sin, state.family, state.section)
    q, k, v = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0]
    if group is not None:
        from .ulysses import repeat_kv_for_group, to_heads, to_sequence

        # the step checked every rank's slice once (equal lengths); no check (host sync) per layer
        q = to_heads(q, group)
        k = to_heads(repeat_kv_for_group(k, state.world), group)
        v = to_heads(repeat_kv_for_group(v, state.world), group)
    if step.total != q.shape[0]:
        raise PackingError(f"tfcompat attention: boundaries cover {step.total} tokens but the layer sees "
                           f"{q.shape[0]}; pass boundaries of the whole (gathered) packed row")
    dropout = self.attention_dropout if self.training else 0.0
    scale = getattr(self, "scaling", None) or d ** -0.5
    out = _varlen(q, k, v, step.cu, step.bounds, step.max_len, causal=True, softmax_scale=scale,
                  window=state.window, dropout_p=dropout)
    if group is not None:
        out = to_sequence(out, group)
    out = out.reshape(1, s, -1)
    if gate is not None:
        out = out * torch.sigmoid(gate)
    out = self.o_proj(out)
    return (out, None, None) if plan.returns == 3 else (out, None)


def _heads(module):
    config = module.config
    return getattr(module, "num_heads", None) or config.num_attention_heads


# ------------------------------------------------------------------------ linear attention
def _linear_forward(self, hidden_states, *args, **kwargs):
    import torch

    state = getattr(self, _ATTR)
    carrier = next((v for v in (*args, *kwargs.values()) if isinstance(v, _StepMask)), None)
    step = carrier.step if carrier is not None else _layer_step(self)
    if step is None:
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


_FORWARDS = {"vl+top": _vl_top_forward, "vl": _vl_forward, "top": _top_forward, "text": _text_model_forward,
             "rotary": _rotary_forward, "layer": _layer_forward,
             "attention": _attention_forward, "linear": _linear_forward}


# ----------------------------------------------------------------------------------- patch
def _install(module, kind, state):
    _uninstall(module)  # never wrap our own forward: patching again replaces
    state.saved_forward = module.__dict__.get("forward")
    setattr(module, _ATTR, state)
    module.forward = _PatchedForward(module, kind)


def _uninstall(module):
    state = module.__dict__.pop(_ATTR, None)
    if not isinstance(state, _State):
        return
    if state.saved_forward is not None:
        module.forward = state.saved_forward
    else:
        module.__dict__.pop("forward", None)


def _is_wrapper(module):
    """torch's activation-checkpoint / offload wrappers (``checkpoint_wrapper``): they replay their module's call."""
    return hasattr(module, "_checkpoint_wrapped_module")


def _unwrapped_children(module):
    """The children of ``module``, each seen through the checkpoint wrappers around it (a wrapper applied to the
    mixers before patch(): the decoder layer still holds the mixer)."""
    for child in module.children():
        while _is_wrapper(child):
            child = child._checkpoint_wrapped_module
        yield child


def _patched_as(module):
    state = module.__dict__.get(_ATTR)
    fwd = module.__dict__.get("forward")
    if isinstance(state, _State) and isinstance(fwd, _PatchedForward) and fwd.module is module:
        return state
    return None


def patch(model: torch.nn.Module, *, remove_padding: bool = True, ulysses_group: Any = None,
          dummy_visual: bool = True, slice_inputs: bool = False) -> PatchRecord:
    """The implementation of :func:`tfcompat.patch` (documented there)."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise ModelError(f"tfcompat.patch: got {type(model).__name__} {str(model)[:60]!r}; it patches a loaded model "
                         f"instance (a torch.nn.Module such as AutoModelForCausalLM.from_pretrained(...) returns), "
                         f"not a config, a family name or a class")
    config = getattr(model, "config", None)
    fam = _family(config if config is not None else model)
    if fam.patch_refusal:
        still = "" if fam.nope else ". tfcompat.rope.apply_rope and tfcompat.config.rope_parameters still do"
        raise UnsupportedTransformersError(f"tfcompat.patch cannot serve {fam.name}: {fam.patch_refusal}{still}")
    from .config import rope_parameters, text_config

    resolutions = tuple(_resolve.resolve(kind, fam.name) for kind in ("rope.init", "rope.apply", "attention.signature"))
    plan = resolutions[2].plan
    module = resolutions[2].target
    attention_cls = getattr(module, fam.attention)
    text_cls = getattr(module, plan.text_model)
    rotary_cls = getattr(module, fam.rotary)
    linear_cls = getattr(module, plan.linear_attention) if plan.linear_attention else None

    world = 1
    if slice_inputs and ulysses_group is None:
        raise UlyssesError("tfcompat.patch: slice_inputs=True slices a whole row over the Ulysses group; pass "
                           "ulysses_group=group with it (or leave slice_inputs off)")
    if ulysses_group is not None:
        import torch.distributed as dist

        world = dist.get_world_size(ulysses_group)
        n_heads = text_config(config).num_attention_heads
        if n_heads % world:
            raise UlyssesError(f"Ulysses: {n_heads} attention heads of {fam.name} do not divide over "
                               f"{world} ranks; choose a group size that divides {n_heads}")
        if linear_cls is not None:
            raise UlyssesError(f"Ulysses: {fam.name} has linear-attention (Gated DeltaNet) layers whose recurrence "
                               f"runs along the sequence; they cannot be split by Ulysses; use ulysses_group=None")

    texts = [m for m in model.modules() if isinstance(m, text_cls)]
    attentions = [m for m in model.modules() if isinstance(m, attention_cls)]
    if not texts or not attentions:
        raise UnsupportedTransformersError(
            f"tfcompat.patch: found {len(texts)} {text_cls.__name__} and {len(attentions)} {attention_cls.__name__} "
            f"modules in {type(model).__name__}; pass a {fam.name} model built by transformers "
            f"{resolutions[0].transformers}"
        )
    targets = []
    if remove_padding or ulysses_group is not None:
        for text in texts:
            rotary = [m for m in text.children() if isinstance(m, rotary_cls)]
            if len(rotary) != 1:
                raise UnsupportedTransformersError(
                    f"tfcompat.patch: {type(text).__name__} of transformers {resolutions[0].transformers} has "
                    f"{len(rotary)} {rotary_cls.__name__} children; tfcompat cannot carry boundaries through it; "
                    f"please report this release")
            targets += [(text, "text"), (rotary[0], "rotary")]
        if not any(model is t for t in texts):
            targets.append((model, "top"))
        mixers = [(m, "attention") for m in attentions]
        mixers += [(m, "linear") for m in model.modules() if linear_cls is not None and isinstance(m, linear_cls)]
        # the decoder layer is the module that holds a token mixer as a child, whatever wraps it
        # (activation-checkpoint or FSDP wrappers sit above it and replay its call)
        mixer_ids = {id(m) for m, _ in mixers}
        targets += [(m, "layer") for m in model.modules()
                    if not _is_wrapper(m) and any(id(c) in mixer_ids for c in _unwrapped_children(m))]
        targets += mixers
    if fam.vision:
        owners = [m for m in model.modules() if "visual" in m._modules and hasattr(m, "get_input_embeddings")]
        targets += [(m, "vl") for m in owners[:1]]
        if owners and any(m is owners[0] for m, kind in targets if kind == "top"):
            targets = [(m, kind) for m, kind in targets if not (m is owners[0] and kind == "top")]
            targets.append((owners[0], "vl+top"))

    def same(m, kind):
        st = _patched_as(m)
        return st is not None and st.kind == kind and st.remove_padding == remove_padding and \
            st.group is ulysses_group and not st.group_lost and st.dummy_visual == dummy_visual and \
            st.slice_inputs == slice_inputs

    from ._window import layer_windows

    windows, windows_how = layer_windows(fam, text_config(config), [m for m, kind in targets if kind == "attention"])
    patched_below = [m for m in model.modules() if _patched_as(m) is not None]
    if not (targets and all(same(m, kind) for m, kind in targets) and len(patched_below) == len(targets)):
        for m in patched_below:
            _uninstall(m)
        for m, kind in targets:
            state = _State(kind, fam.name, remove_padding, ulysses_group, world, dummy_visual=dummy_visual,
                           slice_inputs=slice_inputs)
            if kind == "layer" and linear_cls is not None:
                state.linear_child = any(isinstance(c, linear_cls) for c in m.modules())
            if kind == "attention" and resolutions[1].plan.cos_rows == 3:
                state.section = rope_parameters(m.config, model_type=fam.name).mrope_section
            if kind == "attention":
                state.window = windows[id(m)]
            _install(m, kind, state)
    if not any(kind in ("text", "attention", "linear") for _, kind in targets) and not dummy_visual:
        targets = []  # remove_padding=False, no group, no dummy forward: nothing to do
    n_attn = sum(kind == "attention" for _, kind in targets)
    n_lin = sum(kind == "linear" for _, kind in targets)
    record = PatchRecord(fam.name, text_cls.__name__, n_attn, n_lin, remove_padding, world, resolutions,
                         tuple(windows[id(m)] for m, kind in targets if kind == "attention"), windows_how)
    if targets:
        model.__dict__[_MODEL_ATTR] = record
    else:
        model.__dict__.pop(_MODEL_ATTR, None)
    return record


def unpatch(model: torch.nn.Module) -> bool:
    """Undo :func:`patch`: every patched module below ``model`` gets its original forward back.

    Returns True if anything was patched.
    """
    record = model.__dict__.pop(_MODEL_ATTR, None)
    found = False
    for m in model.modules():
        m.__dict__.pop(_MODEL_ATTR, None)
        if isinstance(m.__dict__.get(_ATTR), _State):
            _uninstall(m)
            found = True
    return found or record is not None
