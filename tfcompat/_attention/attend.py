"""The attention call of a packed step.

The attention call through transformers' own ``AttentionInterface``, where the installed attention forward looks
its attention function up in ``ALL_ATTENTION_FUNCTIONS`` by ``config._attn_implementation`` and hands it its
``**kwargs`` (the ``attention.carrier`` resolution says where: ``interface``).

There upstream's attention forward runs unchanged (projections, norms, gates, RoPE, window, return arity: whatever
the release holds) and tfcompat serves only the call: :func:`packed_attention`, registered under this copy's own key
(:data:`KEY`). The choice is per module: each patched attention module gets its own shallow copy of its config whose
key is :data:`KEY` (:func:`keyed`); the text model, the vision tower, another model and another copy of tfcompat keep
theirs. The step rides down in the attention's own ``**kwargs`` (:data:`STEP`), which a checkpoint's recomputation
replays as arguments. A call that is not a packed step goes to the function of the implementation the model was
loaded with (read from the model's own config at call time), as upstream's forward would have called it.

The call itself, over (tokens, heads, dim) q/k/v: the whole row's (the step's bound kernel, :func:`_attend_row`) or a
sequence-parallel slice's (Ulysses' all-to-all, context parallelism's chunks, :func:`_attend_split`), served to
upstream's attention forward by :func:`packed_attention` and to tfcompat's bundled one (:mod:`.bundled`) by
:func:`attention_forward`.
"""

from __future__ import annotations

import copy
import sys

from .._step import scope as _scope
from .._step.install import (
    _ATTR,
    _CACHE_NAMES,
    _ORIGINAL,
    _PACKAGE,
    _STEP,
    _arguments,
    _carried,
    _lost_step,
    _original,
    unkeyed,
)
from ..errors import PackingError, TfcompatError, UlyssesError

#: the key of :func:`packed_attention` in upstream's registry, and in each patched attention module's config copy:
#: this copy's own (``tfcompat:packed``, or ``myproj._vendor.tfcompat:packed``)
KEY = f"{_PACKAGE}:packed"
#: the keyword the step rides under in the layers' and the attention's kwargs (an identifier of this copy)
STEP = _STEP
#: the implementations whose upstream function reads nothing of ``module.config`` that the copy changes (flash
#: attention on 5.x reads ``module.config._attn_implementation`` to load its kernel): a model loaded with another
#: keeps tfcompat's bundled attention forward
DELEGATES = ("eager", "sdpa", "flex_attention")

_REGISTERED = False


def register():
    """Register :func:`packed_attention` under :data:`KEY` with ``AttentionInterface`` (once per copy)."""
    global _REGISTERED
    if not _REGISTERED:
        from transformers.modeling_utils import AttentionInterface

        AttentionInterface.register(KEY, packed_attention)
        _REGISTERED = True


def original_key(config):
    """The attention implementation a (possibly keyed) attention config's model runs."""
    return getattr(config.__dict__.get(_ORIGINAL, config), "_attn_implementation", None) or "eager"


def keyed(config):
    """A shallow copy of ``config`` whose attention implementation is :data:`KEY`, holding ``config``."""
    config = unkeyed(config)
    out = copy.copy(config)
    out.__dict__["_attn_implementation_internal"] = KEY
    out.__dict__[_ORIGINAL] = config
    return out


def upstream_forward(module, state, step, args, kwargs):
    """A packed step through upstream's attention forward, the step in its kwargs. Eagerly, a forward that returned
    without calling :func:`packed_attention` (an override that runs its own kernel over the whole row) is refused:
    its sequences would have attended to each other."""
    import torch

    if torch.compiler.is_compiling():
        return _original(module, state, *args, **kwargs, **{STEP: step})
    served, saved = step.memo.get(STEP, 0), state.saved_forward
    out = saved(*args, **kwargs, **{STEP: step}) if saved is not None else \
        type(module).forward(module, *args, **kwargs, **{STEP: step})
    if step.memo.get(STEP, 0) == served:
        raise TfcompatError(
            f"tfcompat {state.family}: {type(module).__name__}.forward ran a packed step without calling the attention "
            f"function its config names ({KEY!r}, through ALL_ATTENTION_FUNCTIONS), so its sequences attended to each "
            f"other; an override of the attention forward must call ALL_ATTENTION_FUNCTIONS[self.config."
            f"_attn_implementation] with its **kwargs, as transformers' own does; or unpatch the model and train on "
            f"the padded batch")
    return out


def packed_attention(module, query, key, value, attention_mask, **kwargs):
    """What upstream's attention forward calls under :data:`KEY`: a packed step's attention (its boundaries in
    ``kwargs[STEP]``) over ``(1, heads, tokens, dim)`` q/k/v, as upstream's functions return it
    (``(1, tokens, heads, dim)``, no weights); any other call, upstream's function of the model's implementation."""
    step = kwargs.pop(STEP, None)
    if step is None:
        return _delegate(module, query, key, value, attention_mask, kwargs)
    state = getattr(module, _ATTR)
    import torch

    if not torch.compiler.is_compiling():
        step.memo[STEP] = step.memo.get(STEP, 0) + 1  # served: upstream_forward's tripwire
    # (1, heads, tokens, dim) -> (tokens, heads, dim): squeeze, not [0] (select's backward zero-fills a whole tensor)
    q, k, v = query.squeeze(0).transpose(0, 1), key.squeeze(0).transpose(0, 1), value.squeeze(0).transpose(0, 1)
    scale = kwargs.get("scaling")
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    dropout = kwargs.get("dropout", 0.0)
    if state.group is not None or state.context_group is not None:
        out = _attend_split(state, step, q, k, v, scale, dropout)
    else:
        out = _attend_row(step, q, k, v, scale, state.window, dropout)
    return out.unsqueeze(0), None


def _delegate(module, query, key, value, attention_mask, kwargs):
    """Not a packed step: the function upstream's forward would have called for the model's implementation."""
    impl = original_key(module.config)
    # sdpa asked for attention weights: upstream's forward (4.x) falls back to eager
    if impl == "eager" or (kwargs.get("output_attentions") and impl in ("eager", "sdpa")):
        fn = sys.modules[type(module).__module__].eager_attention_forward
    elif impl in DELEGATES:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        fn = ALL_ATTENTION_FUNCTIONS[impl]
    else:
        raise TfcompatError(
            f"tfcompat: {type(module).__name__} was patched while its model ran {', '.join(DELEGATES)} attention and "
            f"now runs {impl!r}; tfcompat serves this module's attention by its patch-time choice; call "
            f"tfcompat.patch(model) again after changing the attention implementation")
    return fn(module, query, key, value, attention_mask, **kwargs)


def _attend_row(step, q, k, v, scale, window, dropout):
    """Attention over the whole packed row this layer sees (after Ulysses: all of its heads' tokens). Eager, the
    step binds the call once for the layers' layout (the kernel chosen and proven, the boundaries on q's device,
    the kernel's arguments built: ``kernels.bound``) and every layer calls that."""
    import torch

    from .kernels import _varlen

    if step.total != q.shape[0]:
        raise PackingError(f"tfcompat attention: boundaries cover {step.total} tokens but the layer sees "
                           f"{q.shape[0]}; pass boundaries of the whole (gathered) packed row")
    if step.seq is not None:  # a traced step (whole-model torch.compile); not step.bounds: a guard on its length
        from .kernels import _gpu_call, _sdpa_by_seq, traced_kernel

        # boundaries and the longest sequence named by the call (the collator's kwargs, packing.packed): the GPU
        # kernel proven before tracing, as the op it is registered as; else one SDPA call under the step's mask
        if step.cu is not None and step.max_len is not None:
            kind = traced_kernel(q, k, v, True, window, dropout)
            if kind is not None:
                return _gpu_call(kind, q, k, v, step.cu, step.max_len, True, scale, window, dropout)
        return _sdpa_by_seq(q, k, v, step.seq, scale, True, window, dropout)
    if torch.compiler.is_compiling():  # compiled layers: the kernel proven before tracing, decided in the graph
        # no bounds: the compiled kernel reads cu (a guard on the count of Python ints would recompile per count)
        return _varlen(q, k, v, step.cu, None, step.max_len, causal=True, softmax_scale=scale, window=window,
                       dropout_p=dropout)
    key = ("attend", q.device, q.dtype, q.shape[1], k.shape[1], q.shape[2], v.shape[2], scale, window, dropout)
    attend = step.memo.get(key)
    if attend is None:  # the first layer of the step with this layout
        from .kernels import bound

        attend = step.memo[key] = bound(q, k, v, step.cu, step.bounds, step.max_len, causal=True, softmax_scale=scale,
                                        window=window, dropout_p=dropout)
    return attend(q, k, v)


def _attend_split(state, step, q, k, v, scale, dropout):
    """Attention of this rank's slice: Ulysses all-to-all to whole-row heads, and/or context parallel chunks
    attending the whole row's K/V, then back to this rank's tokens."""
    group = state.group
    if group is not None:
        from .._parallel.collectives import repeat_kv_for_group, to_heads

        # the step checked every rank's slice once (equal lengths); no check (host sync) per layer
        q = to_heads(q, group)
        k = to_heads(repeat_kv_for_group(k, state.world), group)
        v = to_heads(repeat_kv_for_group(v, state.world), group)
    if state.context_group is not None:
        # context parallel: this rank's chunks (after Ulysses: of its heads) attend the whole row's K/V
        from .._parallel.context import attend, pieces

        if "context" not in step.memo:  # once per step: Python ints only
            import torch.distributed as dist

            step.memo["context"] = pieces(step, dist.get_rank(state.context_group), state.context_world, q.shape[0])
        out = attend(q, k, v, step, step.memo["context"], state.context_group, scale=scale, window=state.window,
                     dropout_p=dropout)
    else:
        out = _attend_row(step, q, k, v, scale, state.window, dropout)
    if group is not None:
        from .._parallel.collectives import to_sequence

        out = to_sequence(out, group)
    return out


# ------------------------------------------------------------------------------- attention
def attention_forward(self, *args, **kwargs):
    """Every patched attention module runs this and picks the route: upstream's forward with the step in its kwargs
    (the interface route), upstream's forward unchanged (not a packed step), or the body ``patch`` bound where
    upstream's forward does not serve a packed step (``state.body``: :func:`.bundled.bundled_forward`)."""
    state = getattr(self, _ATTR)
    step = kwargs.pop(STEP, None)
    if step is not None:  # the text model handed it down in the layers' kwargs (the interface route)
        return upstream_forward(self, state, step, args, kwargs)
    pe = _carried(args, kwargs)
    hidden = args[0] if args else kwargs.get("hidden_states")
    if pe is None or hidden is None:
        if state.group is None and state.context_group is None and not state.group_lost and \
                _scope.running(state.owner) is None:
            saved = state.saved_forward  # not packed, not split: upstream's attention, unchanged
            return saved(*args, **kwargs) if saved is not None else type(self).forward(self, *args, **kwargs)
        return _attention_unpacked(self, state, args, kwargs)
    step = pe.step
    if state.carrier == "interface":  # upstream's forward, unchanged; the step rides in its kwargs to the call
        return upstream_forward(self, state, step, args, kwargs)
    if state.body is None:  # a state pickled by tfcompat 0.3.0, whose attention forward held the body itself
        raise TfcompatError(
            f"tfcompat {state.family}: this model was patched by an earlier tfcompat and then pickled; its attention "
            f"modules do not name the forward they run; call tfcompat.patch(model) again after loading")
    return state.body(self, state, pe, hidden, _attend_row, _attend_split)  # the call both routes share


def _attention_unpacked(self, state, args, kwargs):
    """Not a packed step: upstream's attention, unchanged (a sequence-parallel one only inside a step)."""
    if _scope.running(state.owner) is not None:  # a tripwire: the carrier was lost
        raise _lost_step(state, self, "the keyword arguments" if state.rides else "the position embeddings")
    if state.split() or state.group_lost:
        given = _arguments(self, args, kwargs)
        if given is not None and not any(given.get(n) is not None for n in _CACHE_NAMES):
            raise UlyssesError(f"tfcompat {state.family}: a Ulysses- or context-parallel-patched attention was "
                               f"called outside a patched text model step; call the model (or its text model), "
                               f"not the layer")
    return _original(self, state, *args, **kwargs)  # not packed: upstream, unchanged
