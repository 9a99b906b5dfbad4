"""tfcompat.patch / tfcompat.unpatch: packed-sequence and Ulysses attention for GLM/Qwen models.

What gets patched, on the model *instance* (never the class, so two models in one process
do not interfere):

* the text decoder stack's forward: decides once per step whether the row is packed and
  where its sequences begin (see "boundaries" below), checks what the packed path cannot
  serve, and on releases whose text model predates 4-row position ids strips the text row;
* where the release's text model hands its ``**kwargs`` down the decoder layers to the attention (the
  ``attention.carrier`` resolution's plan) and the model runs the interface route, that is the carrier: the text
  model adds the step to them under this copy's own keyword, checkpoint recomputation replays it, and neither the
  rotary module nor the layers below are patched. Elsewhere:
* its rotary module: in a packed step, the ``(cos, sin)`` it returns is a tuple that also
  carries the step's boundaries (:class:`_RotaryWithStep`). Decoder layers hand that tuple down
  unchanged, and activation-checkpoint recomputation replays the layer call with the same
  tuple, so boundaries travel *with the call*, never through state recomputation cannot see;
* every decoder layer: finds the boundaries in its arguments (refuses a call that lost them);
  a layer that holds a linear-attention mixer hands them to it as its ``attention_mask``
  (:class:`_StepMask`). Each mixer reads them from its own call's arguments only, so whatever
  recomputes a layer or a mixer alone (any checkpoint recipe, in any thread) replays them.
  Two hand-offs above the layers are thread-local, both inside one forward call where
  upstream's code offers no argument: top-level forward -> text model (the flash-attn keyword
  arguments: 4.51-4.52 VL forwards reject them, and 5.x VL forwards hand ``**kwargs`` to the vision
  tower too, whose flash attention passes its own ``cu_seq_lens_q``) and text model -> its rotary
  module (the step: upstream calls it with ``(x, position_ids)`` only);
  below the rotary module the thread-local only trips an error when a mixer's call lost them;
* every text attention module: projections, q/k norms, Qwen3.5's gated query, RoPE out of place
  through :mod:`.._rope.implementation` (nothing autograd may have saved is written), Ulysses all-to-all,
  :func:`~tfcompat.varlen.varlen_attention`, output projection, in this release's arity;
* Qwen3.5's Gated DeltaNet layers: run per packed sequence, so no recurrent state leaks.

Boundaries, explicit first: ``cu_seq_lens_q`` (+ ``max_length_q``) keyword arguments (what
transformers' flattening collator produces), :func:`tfcompat.packing.packed`, the text row of
4-row position ids, 2-D text ids where a sequence starts at position 0 (transformers' own
rule). An mRoPE temporal row is never read as boundaries. Each source is validated once per
step (:mod:`.._attention.boundaries`); the per-layer code does no host sync.

Fail closed: a packed row (or any Ulysses step) either runs the patched path or raises a
:class:`~tfcompat.errors.TfcompatError`; nothing that could be packed is handed to upstream.
"""


from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from .._attention import attend as _attend
from .._attention import bundled as _bundled
from .._probe import resolve as _resolve
from .._probe.families import family as _family
from .._rope.implementation import kernel_chosen_by_environment
from ..errors import ModelError, UlyssesError, UnsupportedTransformersError
from . import forwards as _layers
from . import text as _text
from . import top as _top
from .install import (
    _ATTR,
    _MODEL_ATTR,
    _PACKAGE,
    _install,
    _is_wrapper,
    _patched_as,
    _State,
    _uninstall,
    _unwrapped_children,
    other_copy,
)

if TYPE_CHECKING:
    import torch

__all__ = ["patch", "unpatch", "PatchRecord"]


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
    #: (:mod:`tfcompat._probe.window`), and how it was decided
    windows: tuple = ()
    windows_how: str = ""
    #: ranks of the context-parallel group (1: none)
    context_world_size: int = 1



#: the forward each kind of patched module runs (module-level functions, held by reference: picklable)
FORWARDS = {"vl+top": _top.vl_top_forward, "vl": _top.vl_forward, "top": _top.top_forward,
            "text": _text.text_model_forward, "rotary": _layers.rotary_forward, "layer": _layers.layer_forward,
            "attention": _attend.attention_forward, "linear": _layers.linear_forward}

def patch(model: torch.nn.Module, *, remove_padding: bool = True, ulysses_group: Any = None,
          dummy_visual: bool = True, slice_inputs: bool = False, context_group: Any = None) -> PatchRecord:
    """The implementation of :func:`tfcompat.patch` (documented there)."""
    fam = _family_of_model(model)
    _refuse_another_copy(model, "patch")
    config = getattr(model, "config", None)
    from .._probe.families import text_config

    resolutions = tuple(_resolve.resolve(kind, fam.name) for kind in ("rope.init", "rope.apply", "attention.signature"))
    plan = resolutions[2].plan
    module = resolutions[2].target
    classes = (getattr(module, plan.text_model), getattr(module, fam.attention), getattr(module, fam.rotary),
               getattr(module, plan.linear_attention) if plan.linear_attention else None)
    world, context_world = _group_sizes(fam, config, classes[3], ulysses_group, context_group, slice_inputs)
    split = remove_padding or ulysses_group is not None or context_group is not None
    targets = _targets(model, fam, classes, split, resolutions[0].transformers)
    state_of = dict(remove_padding=remove_padding, group=ulysses_group, world=world, dummy_visual=dummy_visual,
                    slice_inputs=slice_inputs, context_group=context_group, context_world=context_world)
    from .._probe.window import layer_windows

    attention_targets = [m for m, kind in targets if kind == "attention"]
    windows, windows_how = layer_windows(fam, text_config(config), attention_targets) if attention_targets \
        else ({}, "no attention patched")
    _install_all(model, fam, targets, state_of, classes[3], resolutions, windows)
    if dummy_visual and fam.vision:
        from .dummy import _tie_function

        _tie_function()  # built here: a region torch.compile traces reads it and builds no class
    if not any(kind in ("text", "attention", "linear") for _, kind in targets) and not dummy_visual:
        targets = []  # remove_padding=False, no group, no dummy forward: nothing to do
    n_attn = sum(kind == "attention" for _, kind in targets)
    n_lin = sum(kind == "linear" for _, kind in targets)
    record = PatchRecord(fam.name, classes[0].__name__, n_attn, n_lin, remove_padding, world, resolutions,
                         tuple(windows[id(m)] for m, kind in targets if kind == "attention"), windows_how,
                         context_world)
    if targets:
        model.__dict__[_MODEL_ATTR] = record
        _top.install_generation_positions(model, fam)
    else:
        model.__dict__.pop(_MODEL_ATTR, None)
        _top.uninstall_generation_positions(model)
    return record


def _refuse_another_copy(model, what):
    other = other_copy(model)
    if other is not None:
        package = _PACKAGE
        raise ModelError(
            f"tfcompat {what}: this {type(model).__name__} is patched by another copy of tfcompat, {other}; this copy "
            f"is {package} ({__file__.rpartition('/_step')[0]}). Two copies cannot share a model (one would wrap the "
            f"other's forwards and read only its own boundaries): unpatch it with the copy that patched it "
            f"(<that copy>.unpatch(model)) and patch it with one copy, whose packing.packed and patch your code "
            f"then both use")


def _family_of_model(model):
    """The family of a loaded model instance; anything else, or a family patch() cannot serve, is refused."""
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
    return fam


def _group_sizes(fam, config, linear_cls, ulysses_group, context_group, slice_inputs):
    """(Ulysses world, context world), the groups checked against the model."""
    world = context_world = 1
    if slice_inputs and ulysses_group is None and context_group is None:
        raise UlyssesError("tfcompat.patch: slice_inputs=True slices a whole row over the Ulysses (or context) "
                           "group; pass ulysses_group=group or context_group=group with it (or leave it off)")
    if context_group is not None:
        import torch.distributed as dist

        if linear_cls is not None:
            raise UlyssesError(f"context parallel: {fam.name} has linear-attention (Gated DeltaNet) layers whose "
                               f"recurrent state runs along the sequence from rank to rank; tfcompat does not pass "
                               f"it between ranks yet; use context_group=None")
        context_world = dist.get_world_size(context_group)
    if ulysses_group is not None:
        import torch.distributed as dist

        from .._probe.families import text_config

        world = dist.get_world_size(ulysses_group)
        n_heads = text_config(config).num_attention_heads
        if n_heads % world:
            raise UlyssesError(f"Ulysses: {n_heads} attention heads of {fam.name} do not divide over "
                               f"{world} ranks; choose a group size that divides {n_heads}")
        if linear_cls is not None:
            raise UlyssesError(f"Ulysses: {fam.name} has linear-attention (Gated DeltaNet) layers whose recurrence "
                               f"runs along the sequence; they cannot be split by Ulysses; use ulysses_group=None")
    return world, context_world


def _targets(model, fam, classes, split, release):
    """(module, kind) for every module patch() replaces the forward of."""
    text_cls, attention_cls, rotary_cls, linear_cls = classes
    texts = [m for m in model.modules() if isinstance(m, text_cls)]
    attentions = [m for m in model.modules() if isinstance(m, attention_cls)]
    if not texts or not attentions:
        raise UnsupportedTransformersError(
            f"tfcompat.patch: found {len(texts)} {text_cls.__name__} and {len(attentions)} {attention_cls.__name__} "
            f"modules in {type(model).__name__}; pass a {fam.name} model built by transformers {release}")
    targets = []
    if split:
        for text in texts:
            rotary = [m for m in text.children() if isinstance(m, rotary_cls)]
            if len(rotary) != 1:
                raise UnsupportedTransformersError(
                    f"tfcompat.patch: {type(text).__name__} of transformers {release} has {len(rotary)} "
                    f"{rotary_cls.__name__} children; tfcompat cannot carry boundaries through it; please report "
                    f"this release")
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
    return targets


def _mask_types(config):
    """The layer types a text model indexes its masks by (each layer's ``layer_types`` entry)."""
    return tuple(sorted({"full_attention", "sliding_attention", *(getattr(config, "layer_types", None) or ())}))


def _install_all(model, fam, targets, state_of, linear_cls, resolutions, windows):
    """Install every target's forward with its state; a model already patched the same way is left as it is
    (patching twice is a no-op), else every earlier patch below the model is removed first."""
    from .._rope.settings import rope_parameters

    carrier = _resolve.resolve("attention.carrier", fam.name)
    kernel = kernel_chosen_by_environment()  # TFCOMPAT_ROPE_IMPL=triton: the bundled forward rotates with it
    routed = {id(m): carrier.impl == "interface" and kernel is None and
              _attend.original_key(m.config) in _attend.DELEGATES for m, kind in targets if kind == "attention"}
    moved = next((m for m, kind in targets if kind == "attention" and not routed[id(m)] and
                  _forward_owner(type(m)).__module__ != resolutions[2].target.__name__), None)
    if moved is not None:  # checked before anything is installed
        raise ModelError(
            f"tfcompat.patch: {type(moved).__name__} overrides {fam.attention}.forward; tfcompat serves {fam.name}'s "
            f"packed attention on transformers {carrier.transformers} with its own forward ({carrier.impl}: "
            f"{carrier.reason}; the model runs {_attend.original_key(moved.config)!r}), which would drop what the "
            f"override adds; "
            + (f"TFCOMPAT_ROPE_IMPL={kernel} keeps the bundled forward: unset it (or set 'auto') to run upstream's "
               f"forward with its own rotation" if kernel and carrier.impl == "interface" else
               "where the release routes attention through ALL_ATTENTION_FUNCTIONS load the model with "
               "attn_implementation='sdpa' (or 'eager'), else patch a model of transformers' own classes"))

    def same(m, kind):
        st = _patched_as(m)
        return st is not None and st.kind == kind and st.remove_padding == state_of["remove_padding"] and \
            st.group is state_of["group"] and not st.group_lost and st.dummy_visual == state_of["dummy_visual"] and \
            st.slice_inputs == state_of["slice_inputs"] and st.context_group is state_of["context_group"] and \
            (kind != "attention" or st.carrier == "interface" or st.body is not None)  # 0.3.0's pickles name no body

    # the interface route, the text model's kwargs reaching every mixer: the step rides them (rotary, layers unpatched)
    riding = carrier.impl == "interface" and carrier.plan.kwargs_reach and all(routed.values()) and bool(routed)
    if riding:
        targets = [(m, kind) for m, kind in targets if kind not in ("rotary", "layer")]
    patched_below = [m for m in model.modules() if _patched_as(m) is not None]
    if targets and all(same(m, kind) for m, kind in targets) and len(patched_below) == len(targets):
        return
    for m in patched_below:
        _uninstall(m)
    owner = object()  # this model's token: its text model's step is read only by its own modules (scope.RunningStep)
    for m, kind in targets:
        state = _State(kind, fam.name, owner=owner, **state_of)
        if kind == "linear":
            state.rides = riding
        if kind == "layer" and linear_cls is not None:
            state.linear_child = any(isinstance(c, linear_cls) for c in m.modules())
        if kind == "attention":
            if resolutions[1].plan.cos_rows == 3:
                state.section = rope_parameters(m.config, model_type=fam.name).mrope_section
            state.window, state.rope, state.plan = windows[id(m)], resolutions[1], resolutions[2].plan
            state.body = None if routed[id(m)] else _bundled.bundled_forward  # the forward route: tfcompat's body
            if routed[id(m)]:
                _attend.register()
                state.carrier, state.rides = "interface", riding
        if kind == "text":  # the plan bound here (read per step); masks: none of (tokens, tokens) for a packed row
            state.plan, state.rides = resolutions[2].plan, riding
            state.masks = _mask_types(m.config) if riding and carrier.plan.masks_by_type else None
        _install(m, kind, state, FORWARDS[kind])
        if kind == "attention" and state.carrier == "interface":
            m.config = _attend.keyed(m.config)  # this module's own copy: upstream's lookup finds tfcompat's function


def _forward_owner(cls):
    """The class whose own ``forward`` instances of ``cls`` run (a subclass that only adds hooks, as FSDP2's, runs
    its base's)."""
    return next((c for c in cls.__mro__ if "forward" in c.__dict__), cls)


def unpatch(model: torch.nn.Module) -> bool:
    """Undo :func:`patch`: every patched module below ``model`` gets its original forward back.

    Returns True if anything was patched.
    """
    import torch

    if isinstance(model, torch.nn.Module):
        _refuse_another_copy(model, "unpatch")
    record = model.__dict__.pop(_MODEL_ATTR, None)
    _top.uninstall_generation_positions(model)
    found = False
    for m in model.modules():
        m.__dict__.pop(_MODEL_ATTR, None)
        if isinstance(m.__dict__.get(_ATTR), _State):
            _uninstall(m)
            found = True
    return found or record is not None
