"""The patched forwards, each a module-level function of ``(module, *args, **kwargs)`` installed by reference
(:data:`.patch.FORWARDS`): here the rotary module (hands the step to the layers on its output), the decoder layers,
the attention and the linear-attention mixers, which read only their arguments, the step and what patch time
bound; the text model's in :mod:`.text`, the top model's and the vision owner's in :mod:`.top`. And the step's
rotation: the :class:`~.._kernels.rotation.Rotation` of this step's (cos, sin) for each (q, k) layout, made by the
first layer that asks and kept on the step's carrier (:func:`for_layers`), the traced rotation under torch.compile
(:func:`rotate`), and the once-a-step check of what the rotary module returned (:func:`check_cos`).
"""

from __future__ import annotations

from .._kernels.rotation import Rotation, chosen_impl
from .._probe import resolve as _resolve
from .._probe.families import family as family_of
from ..errors import PackingError, RopeShapeError, TfcompatError, UlyssesError
from . import scope as _carrier
from .install import (
    _ATTR,
    _CACHE_NAMES,
    _FLASH_KWARGS,
    _arguments,
    _Carried,
    _original,
    _signature,
    _StepMask,
)


def rotary_forward(self, *args, **kwargs):
    state = getattr(self, _ATTR)
    out = _original(self, state, *args, **kwargs)
    entry = _carrier.call_entry()
    if isinstance(entry, _carrier.Active) and isinstance(out, tuple):
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


def layer_forward(self, *args, **kwargs):
    state = getattr(self, _ATTR)
    pe = kwargs.get("position_embeddings")
    if not isinstance(pe, _Carried):
        pe = None if "position_embeddings" in kwargs else _carried(args, kwargs)
    if pe is None:
        if isinstance(_carrier.call_entry(), _carrier.Active):  # a tripwire: the step's carrier was lost
            raise TfcompatError(
                f"tfcompat {state.family}: {type(self).__name__} did not receive the position embeddings of this "
                f"packed step, so it cannot tell where sequences begin; a wrapper around the decoder layer that "
                f"drops keyword arguments would do this (wrap the layers with torch's checkpoint_wrapper or "
                f"tfcompat.enable_checkpointing); if nothing wraps it, this transformers release passes them "
                f"differently: please report it (transformers {_resolve._version.transformers_version()})")
    elif state.linear_child:
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
def attention_forward(self, *args, **kwargs):
    """Every layer of a packed step runs this: it reads its arguments, the step (on the position embeddings) and
    what patch time bound (``state``); the rotation is prepared once per step (:func:`for_layers`)."""
    import torch

    state = getattr(self, _ATTR)
    pe = kwargs.get("position_embeddings")
    if not isinstance(pe, _Carried):
        pe = None if "position_embeddings" in kwargs else _carried(args, kwargs)
    hidden = args[0] if args else kwargs.get("hidden_states")
    if pe is None or hidden is None:
        if state.group is None and state.cgroup is None and not state.group_lost and \
                not isinstance(_carrier.call_entry(), _carrier.Active):
            saved = state.saved_forward  # not packed, not split: upstream's attention, unchanged
            return saved(*args, **kwargs) if saved is not None else type(self).forward(self, *args, **kwargs)
        return _attention_unpacked(self, state, args, kwargs)
    step = pe.step
    if hidden.shape[0] != 1:
        raise PackingError(f"tfcompat {state.family}: the packed attention needs batch 1, got batch "
                            f"{hidden.shape[0]}")
    if state.group_lost:
        state.group_or_raise()


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
        q, k = rot.call(q, k)
    # squeeze, not q[0]: select's backward allocates and zero-fills a whole (1, heads, s, d) gradient per tensor
    q, k, v = q.squeeze(0).transpose(0, 1), k.squeeze(0).transpose(0, 1), v.squeeze(0)
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
    """Attention over the whole packed row this layer sees (after Ulysses: all of its heads' tokens). Eager, the
    step binds the call once for the layers' layout (the kernel chosen and proven, the boundaries on q's device,
    the kernel's arguments built: ``varlen.bound``) and every layer calls that."""
    import torch

    from .._kernels.varlen import _varlen

    if step.total != q.shape[0]:
        raise PackingError(f"tfcompat attention: boundaries cover {step.total} tokens but the layer sees "
                           f"{q.shape[0]}; pass boundaries of the whole (gathered) packed row")
    if step.bounds is None:  # a traced step (whole-model torch.compile)
        from .._kernels.varlen import _gpu_call, _sdpa_by_seq, traced_kernel

        # boundaries and the longest sequence named by the call (the collator's kwargs, packing.packed): the GPU
        # kernel proven before tracing, as the op it is registered as; else one SDPA call under the step's mask
        if step.cu is not None and step.max_len is not None:
            kind = traced_kernel(q, k, v, True, window, dropout)
            if kind is not None:
                return _gpu_call(kind, q, k, v, step.cu, step.max_len, True, scale, window, dropout)
        return _sdpa_by_seq(q, k, v, step.seq, scale, True, window, dropout)
    if torch.compiler.is_compiling():  # compiled layers: the kernel proven before tracing, decided in the graph
        return _varlen(q, k, v, step.cu, step.bounds, step.max_len, causal=True, softmax_scale=scale, window=window,
                       dropout_p=dropout)
    key = ("attend", q.device, q.dtype, q.shape[1], k.shape[1], q.shape[2], v.shape[2], scale, window, dropout)
    attend = step.memo.get(key)
    if attend is None:  # the first layer of the step with this layout
        from .._kernels.varlen import bound

        attend = step.memo[key] = bound(q, k, v, step.cu, step.bounds, step.max_len, causal=True, softmax_scale=scale,
                                        window=window, dropout_p=dropout)
    return attend(q, k, v)


def _attend_split(state, step, q, k, v, scale, dropout):
    """Attention of this rank's slice: Ulysses all-to-all to whole-row heads, and/or context parallel chunks
    attending the whole row's K/V, then back to this rank's tokens."""
    group = state.group
    if group is not None:
        from .._kernels.collectives import repeat_kv_for_group, to_heads

        # the step checked every rank's slice once (equal lengths); no check (host sync) per layer
        q = to_heads(q, group)
        k = to_heads(repeat_kv_for_group(k, state.world), group)
        v = to_heads(repeat_kv_for_group(v, state.world), group)
    if state.cgroup is not None:
        # context parallel: this rank's chunks (after Ulysses: of its heads) attend the whole row's K/V
        from .._kernels.context import attend, pieces

        if "context" not in step.memo:  # once per step: Python ints only
            import torch.distributed as dist

            step.memo["context"] = pieces(step, dist.get_rank(state.cgroup), state.cworld, q.shape[0])
        out = attend(q, k, v, step, step.memo["context"], state.cgroup, scale=scale, window=state.window,
                     dropout_p=dropout)
    else:
        out = _attend_row(step, q, k, v, scale, state.window, dropout)
    if group is not None:
        from .._kernels.collectives import to_sequence

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
def linear_forward(self, hidden_states, *args, **kwargs):
    import torch

    state = getattr(self, _ATTR)
    carrier = _carrier.first((v for v in (*args, *kwargs.values()) if isinstance(v, _StepMask)), None)
    step = carrier.step if carrier is not None else None
    if step is None:
        if _in_step():
            raise _lost_step(state, self, "the attention mask")
        return _original(self, state, hidden_states, *args, **kwargs)
    args = tuple(None if v is carrier else v for v in args)
    cache = _carrier.first((kwargs[n] for n in _CACHE_NAMES if kwargs.get(n) is not None), args[0] if args else None)
    if cache is not None or hidden_states.shape[0] != 1:
        raise PackingError(f"tfcompat {state.family}: the packed linear attention takes batch 1 and no cache")
    kwargs = {k: v for k, v in kwargs.items() if k not in _FLASH_KWARGS + ("position_ids", "attention_mask")}
    # The torch fallback of transformers ignores cu_seqlens, so run each sequence on its own:
    # exact, and no recurrent or convolution state crosses a boundary.
    b = step.bounds
    outs = [_original(self, state, hidden_states[:, lo:hi], *args, **kwargs) for lo, hi in zip(b[:-1], b[1:])]
    return torch.cat(outs, dim=1)


def for_layers(carried, q, k, family, section, res):
    """The rotation of this step's (cos, sin) for q and k of this layout, made by the first layer that asks and
    kept on the step's carrier for the others (unless cos/sin need gradients)."""
    cos, sin = carried
    fam = family_of(family)
    rot = Rotation(q, k, cos, sin, fam.name, res, 2, 1, section, False, chosen_impl(None))
    if rot.cacheable:
        carried.rotations[(q.dtype, q.shape, k.shape, q.stride(), k.stride())] = rot
    return rot


def rotate(q, k, cos, sin, model_type, mrope_section, resolution=None):
    """The patched attention's rotation under torch.compile (traced: nothing kept between layers): out of place,
    (batch, heads, seq, head_dim), with the cos/sin that this release's rotary module returned (checked once
    per step, :func:`check_cos`), the sections and the ``rope.apply`` resolution bound at patch time."""
    fam = family_of(model_type)
    res = resolution if resolution is not None else _resolve.resolve("rope.apply", fam.name)
    return Rotation(q, k, cos, sin, fam.name, res, 2, 1, mrope_section, False, chosen_impl(None))(q, k)


def check_cos(model_type, cos, sin):
    """Raise :class:`RopeShapeError` unless (cos, sin) have the layout this release's attention expects."""
    import torch

    fam = family_of(model_type)
    res = _resolve.resolve("rope.apply", fam.name)
    if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)):
        raise RopeShapeError(f"tfcompat {fam.name}: the rotary module returned {type(cos).__name__}, "
                             f"{type(sin).__name__}; expected two tensors")
    want = 4 if res.plan.cos_rows == 3 else 3
    if cos.shape != sin.shape or cos.dim() != want or cos.shape[-1] % 2:
        raise RopeShapeError(f"tfcompat {fam.name}: the rotary module returned cos {tuple(cos.shape)} and sin "
                             f"{tuple(sin.shape)}; transformers {res.transformers} attention expects "
                             f"{'(3, batch, seq, dim)' if want == 4 else '(batch, seq, dim)'} with an even dim")
