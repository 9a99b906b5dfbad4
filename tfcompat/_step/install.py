"""What a patched module carries: its state, the callable that replaces its ``forward`` (keeping upstream's
signature), the carriers of a packed step's boundaries, and installing / removing them on one module.

Used by :mod:`.forwards`, :mod:`.._attention.attend` (the forwards) and :mod:`.patch` (``patch()``); imports none
of them.
"""

from __future__ import annotations

import copy
import inspect
import types

from ..errors import TfcompatError, UlyssesError
from .scope import FLASH_KWARGS

_ATTR = "_tfcompat_patch"          # per patched module: its _State
_MODEL_ATTR = "_tfcompat_model"    # per model passed to patch(): its record
_FLASH_KWARGS = FLASH_KWARGS
_CACHE_NAMES = ("cache", "past_key_values", "past_key_value", "cache_params")
#: the keyword a packed step rides under from the text model down the decoder layers' ``**kwargs`` to the
#: attention (the interface route): an identifier of this copy, which another copy neither reads nor sets
_STEP = "packed_step__" + __name__.rpartition("._step")[0].replace(".", "__")  # this module's package


class _State:
    """Per patched module. Picklable and deep-copyable: a copy shares the (unpicklable) process group;
    a pickled copy forgets it and asks to be patched again before a Ulysses step."""

    calls = context_group = body = owner = None  # for states pickled before these existed (0.3.0's, say)
    rides, context_world, carrier = False, 1, "forward"  # 0.3.0 had only the forward route
    masks = None  # the text model: the layer types whose masks a packed step hands as None (CarrierPlan.masks_by_type)

    def __init__(self, kind, family, remove_padding, group, world, saved_forward=None, dummy_visual=True,
                 slice_inputs=False, context_group=None, context_world=1, owner=None):
        self.kind, self.family, self.remove_padding = kind, family, remove_padding
        self.context_group, self.context_world = context_group, context_world  # context parallel: zigzag chunks
        self.slice_inputs = slice_inputs  # Ulysses: every rank passes the whole row; the text model slices it
        self.dummy_visual = dummy_visual
        self.section = None  # attention modules: mRoPE sections, read from the config once at patch time
        self.window = None  # attention modules: the sliding window upstream uses on this layer (patch time)
        self.rope = self.plan = None  # attention modules: the rope.apply resolution and attention plan
        self.group, self.world, self.saved_forward, self.group_lost = group, world, saved_forward, False
        self.linear_child = False  # decoder layers: holds a linear-attention mixer (gets a _StepMask)
        self.carrier = "forward"  # attention modules: "interface" where upstream's forward runs (.attend)
        self.body = None  # attention modules on the forward route: tfcompat's own attention body (.bundled)
        self.owner = owner  # the token patch() gives every state of one model (scope.RunningStep names its model)
        self.rides = False  # text model, mixers: the step rides down the layers' kwargs (rotary, layers unpatched)
        self.fn = None  # the module-level forward installed (kept to bind it again after unpickling)
        self.restored = False  # unpickled: the shared forward is bound again at the text model's first call
        self.calls = None  # the text model and the vision owner: boundaries by input, for a checkpoint's replay

    def __deepcopy__(self, memo):
        new = copy.copy(self)
        new.saved_forward = copy.deepcopy(self.saved_forward, memo)
        new.restored = False  # a deep copy copies the bound forwards too (copy._deepcopy_method)
        new.calls, new.owner = None, copy.deepcopy(self.owner, memo)  # the copy's states share a token of their own
        return new

    def __getstate__(self):
        state = dict(self.__dict__)
        if state["group"] is not None or state.get("context_group") is not None:
            state["group"], state["context_group"], state["group_lost"] = None, None, True
        state["restored"] = True
        state["calls"] = None
        return state

    def split(self):
        """The keyword arguments naming this model's sequence groups (for tfcompat.ulysses' slice/gather)."""
        out = {}
        if self.group is not None:
            out["group"] = self.group
        if self.context_group is not None:
            out["context_group"] = self.context_group
        return out

    def group_or_raise(self):
        if self.group_lost:
            raise UlyssesError(
                f"tfcompat: this {self.family} model was patched for Ulysses (or context parallel) and then pickled or "
                f"saved; a process group cannot travel with it; call tfcompat.patch(model, ulysses_group=group) "
                f"(or context_group=) again after loading"
            )
        return self.group


class _PatchedForward:
    """What a patched module's ``forward`` is: a picklable callable bound to its module, holding the forward
    it runs by reference (a module-level function of ``forwards``, pickled by its name)."""

    def __init__(self, module, kind, fn):
        self.module, self.kind, self.fn = module, kind, fn

    def __call__(self, *args, **kwargs):
        return self.fn(self.module, *args, **kwargs)

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


class _RotaryWithStep(tuple):
    """``(cos, sin)`` that also carries the step's boundaries down to the layers, and the rotations the layers
    prepared from them (:func:`.._attention.bundled.for_layers`, keyed by the (q, k) layout)."""

    step = None
    rotations = None


class _StepMask:
    """What a decoder layer that holds a linear-attention mixer passes as ``attention_mask`` in a packed step:
    the step's boundaries, handed to the mixer through its own call, so a checkpoint wrapper around the mixer
    alone replays the call with them (the full-attention mixers get theirs through ``_RotaryWithStep``)."""

    def __init__(self, step):
        self.step = step

    def __repr__(self):
        return f"<tfcompat packed-step boundaries {list(self.step.bounds)}>"


def _remember_explicit(state, inputs, explicit):
    """The boundaries a top-level call handed (through the scope) to this module (``state``'s) for its ``inputs``
    (input ids or embeddings): kept on the module's own state, weakly keyed by them, for a checkpoint wrapper around
    the module (``checkpoint_wrapper(model.model)``) whose recomputation replays the module's call in backward,
    outside the top-level call. Per module: another model, or another copy of tfcompat, never reads them."""
    import torch

    if torch.compiler.is_compiling():
        return  # traced: a checkpoint inside the compiled region replays the traced graph, boundaries included
    if state.calls is None:
        from torch.utils.weak import WeakIdKeyDictionary

        state.calls = WeakIdKeyDictionary()
    state.calls[inputs] = explicit


def _recalled_explicit(state, inputs):
    """The boundaries of this module's forward call being recomputed in backward with this same input, or None."""
    import torch

    if state.calls is None or inputs is None or torch.compiler.is_compiling() or \
            torch._C._current_graph_task_id() == -1:
        return None
    return state.calls.get(inputs)


# ----------------------------------------------------------------------------------- helpers
def decoding(given):
    """Whether a call (its arguments by name) is generate()'s: a KV cache, or ``cache_position`` with caching (5.0-5.2's
    prefill, which creates the cache). The one reading of it: the text model, the vision owner and the labels."""
    return any(given.get(n) is not None for n in _CACHE_NAMES) or \
        (given.get("cache_position") is not None and given.get("use_cache") is not False)


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


#: the kinds installed many times in one model (every decoder layer and token mixer): their forward is a bound
#: method of one function per (kind, class), which torch.compile guards by that function and takes the module
#: as an input, as it does upstream's forwards, so every layer shares one compiled graph. A callable object per
#: module (``_PatchedForward``) is guarded by its identity: each layer compiled apart until dynamo's recompile
#: limit. The modules patched once per model (top, text, rotary, vision owner) keep ``_PatchedForward``.
_SHARED_KINDS = ("attention", "layer", "linear")
_SHARED: dict = {}


def _shared(kind, fn, cls):
    """The forward every ``cls`` module of ``kind`` is bound to: runs ``fn``, shows ``cls.forward``'s signature."""
    key = (kind, fn, cls)
    shared = _SHARED.get(key)
    if shared is None:
        # a copy of fn itself (its code, globals, defaults): no frame more per call than fn, and a signature of its
        # own (``cls.forward``'s) where fn serves every class
        # named ``forward``: a pickled bound method is ``getattr(module, "forward")`` (see rebind_restored)
        forward = types.FunctionType(fn.__code__, fn.__globals__, "forward", fn.__defaults__, fn.__closure__)
        forward.__kwdefaults__ = fn.__kwdefaults__
        forward.__qualname__ = f"tfcompat_{kind}_forward"
        forward.__module__ = fn.__module__
        try:
            forward.__signature__ = inspect.signature(inspect.unwrap(cls.forward))
        except (TypeError, ValueError):
            pass
        forward._tfcompat_key = (kind, fn)
        _SHARED[key] = shared = forward
    return shared


def rebind_restored(root):
    """After unpickling: bind the shared forwards again below ``root`` (the patched text model, at its first call).

    Python pickles a bound method as ``getattr(module, its __name__)``, evaluated before the module's own state is
    restored; the shared forwards are named ``forward``, so an unpickled module holds its class's forward until
    this runs (no process-wide pickling hook: the user's other bound methods pickle as Python pickles them)."""
    for m in root.modules():
        state = m.__dict__.get(_ATTR)
        if isinstance(state, _State) and state.restored:
            state.restored = False
            if state.kind in _SHARED_KINDS and state.saved_forward is None and state.fn is not None and \
                    not _ours(m, m.__dict__.get("forward")):
                m.forward = types.MethodType(_shared(state.kind, state.fn, type(m)), m)


def _install(module, kind, state, fn):
    _uninstall(module)  # never wrap our own forward: patching again replaces
    _signature(type(module))  # read at patch time: a first read under torch.compile guards on the cache's contents
    state.saved_forward = module.__dict__.get("forward")
    state.fn = fn
    setattr(module, _ATTR, state)
    if kind in _SHARED_KINDS and state.saved_forward is None:
        module.forward = types.MethodType(_shared(kind, fn, type(module)), module)
    else:  # a forward set on the instance before (another wrapper's): its own signature, one object
        module.forward = _PatchedForward(module, kind, fn)


def _ours(module, fwd):
    """Whether ``fwd`` is the forward tfcompat installed on ``module``."""
    if isinstance(fwd, _PatchedForward):
        return fwd.module is module
    return isinstance(fwd, types.MethodType) and fwd.__self__ is module and \
        getattr(fwd.__func__, "_tfcompat_key", None) is not None and \
        package_of(fwd.__func__.__module__) == _PACKAGE  # this copy's, not another copy's


def _uninstall(module):
    state = module.__dict__.pop(_ATTR, None)
    if not isinstance(state, _State):
        return
    if state.saved_forward is not None:
        module.forward = state.saved_forward
    else:
        module.__dict__.pop("forward", None)
    if state.kind == "attention" and state.carrier == "interface":
        module.config = unkeyed(module.config)


#: where an attention module's config copy (:func:`.._attention.attend.keyed`) keeps the config it copied
_ORIGINAL = "_packed_original_config"


def unkeyed(config):
    """The config a keyed copy was made from (``config`` itself where it is not a copy)."""
    return config.__dict__.get(_ORIGINAL, config)


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


def other_copy(model):
    """The package name and version of another copy of tfcompat that patched ``model`` or a module below it (a
    framework's vendored copy beside the installed package: same attribute names, other classes), or None. Two copies
    never share a model: the second would wrap the first's forwards (a recursion) and read its own carriers only."""
    import sys

    for m in model.modules():
        for key in (_ATTR, _MODEL_ATTR):
            mine = _State if key == _ATTR else None
            value = m.__dict__.get(key)
            if value is None or (mine is not None and isinstance(value, mine)) or \
                    (mine is None and package_of(type(value).__module__) == _PACKAGE):
                continue
            package = package_of(type(value).__module__) or type(value).__module__
            version = getattr(sys.modules.get(package), "__version__", "?")
            where = getattr(sys.modules.get(package), "__file__", None)
            return f"{package} {version}" + (f" ({where.rpartition('/')[0]})" if where else "")
    return None


def package_of(module_name):
    """The package of a module one folder below it (``tfcompat._attention.attend``: ``tfcompat``)."""
    return module_name.rpartition(".")[0].rpartition(".")[0]


_PACKAGE = package_of(__name__)  # this copy's package (``tfcompat``, or ``myproj._vendor.tfcompat``)


def _patched_as(module):
    state = module.__dict__.get(_ATTR)
    fwd = module.__dict__.get("forward")
    if isinstance(state, _State) and _ours(module, fwd):
        return state
    return None


# ------------------------------------------------------------------- the step's carriers, read
def _carried(args, kwargs):
    """The step's carrier among a layer's arguments (keyword ``position_embeddings`` first), or None: also where
    something rebuilt the tuple as its own class without the step (FSDP2's input cast does ``type(x)(...)``)."""
    pe = kwargs.get("position_embeddings")
    if "position_embeddings" in kwargs:
        return pe if isinstance(pe, _RotaryWithStep) and pe.step is not None else None
    for v in (*args, *kwargs.values()):
        if isinstance(v, _RotaryWithStep):
            return v if v.step is not None else None
    return None


def _lost_step(state, module, what):
    return TfcompatError(
        f"tfcompat {state.family}: {type(module).__name__} was called in a packed step without {what} its decoder "
        f"layer passed (they carry the step's boundaries); something between the layer and the mixer rebuilt "
        f"them (a forward pre-hook or wrapper that copies or casts the arguments); pass them through unchanged, "
        f"or unpatch the model")
