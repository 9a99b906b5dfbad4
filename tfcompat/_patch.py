"""tfcompat.patch / tfcompat.unpatch: packed-sequence and Ulysses attention for GLM/Qwen models.

What gets patched, on the model *instance* (never the class, so two models in one process
do not interfere):

* the text decoder stack's forward: reads sequence boundaries once per step (from
  ``cu_seq_lens_q`` keyword arguments, or the text row of 4-row position ids, or 2-D ids
  that restart), all-gathers them over the Ulysses group, and hands them to the layers; on
  releases whose text model predates 4-row position ids it strips the text row;
* every text attention module: projections, q/k norms, Qwen3.5's gated query, RoPE through
  :func:`~tfcompat.rope.apply_rope_` (in place on the fresh projections), Ulysses
  all-to-all, :func:`~tfcompat.varlen.varlen_attention`, output projection, returned in the
  arity this release's decoder layer expects;
* Qwen3.5's Gated DeltaNet layers: run per packed sequence, so no recurrent state leaks
  from one sequence into the next.

Anything the patched forwards do not handle (a KV cache, ``output_attentions``, a padded
batch with no packing) falls through to the original forward unchanged.
"""

import dataclasses
import importlib
import inspect
import re
import types

from . import _resolve
from . import packing as _packing
from ._families import family as _family
from .errors import TfcompatError, UnsupportedTransformersError

__all__ = ["patch", "unpatch", "PatchRecord"]

_ATTR = "_tfcompat_patch"          # per patched module: its _State
_MODEL_ATTR = "_tfcompat_model"    # per model passed to patch(): its _ModelState


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    params: tuple
    varkw: str
    returns: int
    text_model: str
    four_row_ids: bool
    linear_attention: str


def _resolve_attention(fam, capability):
    module = _resolve._modeling(fam, capability)
    attention = _resolve._attr(module, fam.attention, capability)
    fn = inspect.unwrap(attention.forward)
    sig = inspect.signature(fn)
    params = tuple(p for p in sig.parameters if p != "self")
    varkw = next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), "")
    body = _resolve._source(fn)
    returns = 3 if re.search(r"return\s+attn_output\s*,\s*attn_weights\s*,\s*past_key_value", body) else 2
    text_model = next((n for n in (f"{fam.prefix}TextModel", f"{fam.prefix}Model") if hasattr(module, n)), "")
    if not text_model:
        raise UnsupportedTransformersError(f"{capability}: no {fam.prefix}TextModel / {fam.prefix}Model in "
                                           f"{module.__name__}")
    text_src = _resolve._source(getattr(module, text_model).forward)
    four = bool(re.search(r"shape\[0\]\s*==\s*4", text_src))
    linear = f"{fam.prefix}GatedDeltaNet" if hasattr(module, f"{fam.prefix}GatedDeltaNet") else ""
    reason = (f"{fam.attention}.forward({', '.join(params)}) returns a {returns}-tuple; {text_model}.forward "
              f"{'splits 4-row position ids' if four else 'takes 3-row position ids only (tfcompat strips the text row)' if fam.vision else 'takes 2-D position ids'}")
    plan = AttentionPlan(params, varkw, returns, text_model, four, linear)
    return _resolve.Resolution(capability, "bundled", f"{module.__name__}.{fam.attention}.forward",
                               reason, str(_resolve._version.transformers_version()), plan, module)


_resolve.register("attention.signature", _resolve_attention)


@dataclasses.dataclass(frozen=True)
class PatchRecord:
    """What :func:`patch` did."""

    family: str
    text_model: str
    attention_modules: int
    linear_attention_modules: int
    remove_padding: bool
    ulysses_world_size: int
    resolutions: tuple


@dataclasses.dataclass
class _State:
    family: str
    plan: object
    rope_plan: object
    section: tuple
    group: object
    world: int
    signature: inspect.Signature
    saved_forward: object


# ----------------------------------------------------------------------------------- helpers
def _original(module, state, *args, **kwargs):
    if state.saved_forward is not None:
        return state.saved_forward(*args, **kwargs)
    return type(module).forward(module, *args, **kwargs)


def _arguments(state, module, args, kwargs):
    try:
        bound = state.signature.bind(module, *args, **kwargs)
    except TypeError:
        return None
    out = dict(bound.arguments)
    out.pop("self", None)
    for name, value in list(out.items()):
        if state.signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            out.pop(name)
            out.update(value)
    return out


def _t_row_decreases(ids):
    t = ids[0, 0]
    return bool((t[1:] < t[:-1]).any())


def _boundaries(state, position_ids, extra):
    """(cu_seqlens, max_seqlen) of the global sequence, or None; may return replacement ids."""
    import torch

    from .varlen import cu_seqlens_from_position_ids

    cu = extra.get("cu_seq_lens_q", extra.get("cumulative_seqlens_q"))
    if cu is not None:
        max_len = extra.get("max_length_q")
        return (cu, int(max_len) if max_len is not None else None), position_ids
    if position_ids is None:
        return None, position_ids
    text, replacement = None, position_ids
    if position_ids.dim() == 3 and position_ids.shape[0] == 4:
        text = position_ids[0]
        if not state.plan.four_row_ids:
            replacement = position_ids[1:]  # this release's text model predates the 4-row layout
    elif position_ids.dim() == 2:
        text = position_ids
    elif position_ids.dim() == 3 and position_ids.shape[1] == 1 and _t_row_decreases(position_ids):
        raise _packing_error(position_ids)
    if text is None or text.shape[0] != 1:
        return None, replacement
    if state.group is not None:
        from .ulysses import gather_from_ranks

        text = gather_from_ranks(text, dim=1, group=state.group)
    elif not bool((text[0, 1:] != text[0, :-1] + 1).any()):
        return None, replacement  # one sequence: nothing to separate
    return cu_seqlens_from_position_ids(text), replacement


def _packing_error(ids):
    from .varlen import PackingError

    return PackingError(
        f"tfcompat: position ids of shape {tuple(ids.shape)} hold several packed sequences (the temporal row "
        f"restarts), but 3-row mRoPE ids cannot mark where each begins; pass 4-row ids "
        f"(tfcompat.packing.pack builds them) or wrap the call in tfcompat.packing.packed(cu_seqlens)"
    )


# ------------------------------------------------------------------------------ text model
def _text_model_forward(self, *args, **kwargs):
    state = getattr(self, _ATTR)
    a = _arguments(state, self, args, kwargs)
    if a is None:
        return _original(self, state, *args, **kwargs)
    position_ids = a.get("position_ids")
    bounds, replacement = _boundaries(state, position_ids, a)
    changed = {}
    if replacement is not position_ids:
        changed["position_ids"] = replacement
    if bounds is not None and a.get("attention_mask") is None and "attention_mask" in state.signature.parameters:
        # an explicit all-ones mask keeps upstream mask builders from re-reading packed position
        # ids (some releases cannot parse 3-row ids there); patched attention ignores the mask
        import torch

        ref = a.get("input_ids") if a.get("input_ids") is not None else a.get("inputs_embeds")
        changed["attention_mask"] = torch.ones(ref.shape[:2], dtype=torch.long, device=ref.device)
    if changed:
        a.update(changed)
        args, kwargs = (), a  # all by keyword: decorators upstream inject keywords of their own
    if bounds is None:
        return _original(self, state, *args, **kwargs)
    with _packing.packed(bounds[0], bounds[1]):
        return _original(self, state, *args, **kwargs)


# ------------------------------------------------------------------------------- attention
def _attention_forward(self, *args, **kwargs):
    import torch

    state = getattr(self, _ATTR)
    a = _arguments(state, self, args, kwargs)
    if a is None:
        return _original(self, state, *args, **kwargs)
    cache = next((a[n] for n in ("cache", "past_key_values", "past_key_value") if a.get(n) is not None), None)
    pe = a.get("position_embeddings")
    hidden = a["hidden_states"]
    if cache is not None or a.get("output_attentions") or pe is None or hidden.shape[0] != 1:
        return _original(self, state, *args, **kwargs)
    bounds = _packing.current()
    if bounds is None:
        bounds, _ = _boundaries(state, a.get("position_ids"), a)
    if bounds is None and state.group is None:
        return _original(self, state, *args, **kwargs)

    from .rope import apply_rope_
    from .varlen import varlen_attention

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
    q, k = apply_rope_(q, k, cos, sin, model_type=state.family, mrope_section=state.section)
    q, k, v = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0]
    if state.group is not None:
        from .ulysses import gather_heads_scatter_seq, gather_seq_scatter_heads, repeat_kv_for_group

        q = gather_seq_scatter_heads(q, state.group)
        k = gather_seq_scatter_heads(repeat_kv_for_group(k, state.world), state.group)
        v = gather_seq_scatter_heads(repeat_kv_for_group(v, state.world), state.group)
        if bounds is None:
            total = q.shape[0]
            bounds = (torch.tensor([0, total], dtype=torch.int32, device=q.device), total)
    cu, max_len = bounds
    if int(cu[-1]) != q.shape[0]:
        from .varlen import PackingError

        raise PackingError(f"tfcompat attention: boundaries cover {int(cu[-1])} tokens but the layer sees "
                           f"{q.shape[0]}; pass boundaries of the whole (gathered) packed row")
    dropout = self.attention_dropout if self.training else 0.0
    scale = getattr(self, "scaling", None) or d ** -0.5
    out = varlen_attention(q, k, v, cu, max_len, causal=True, softmax_scale=scale, window=_window(self),
                           dropout_p=dropout)
    if state.group is not None:
        out = gather_heads_scatter_seq(out, state.group)
    out = out.reshape(1, s, -1)
    if gate is not None:
        out = out * torch.sigmoid(gate)
    out = self.o_proj(out)
    return (out, None, None) if state.plan.returns == 3 else (out, None)


def _heads(module):
    config = module.config
    return getattr(module, "num_heads", None) or config.num_attention_heads


def _window(module):
    window = getattr(module, "sliding_window", None)
    if window is None and "sliding_window" not in vars(module):
        # releases before 4.53 decide per call from the config (Qwen2 family)
        config = module.config
        if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None) and \
                getattr(module, "layer_idx", 0) >= getattr(config, "max_window_layers", 0):
            window = config.sliding_window
    return window


# ------------------------------------------------------------------------ linear attention
def _linear_forward(self, hidden_states, *args, **kwargs):
    import torch

    state = getattr(self, _ATTR)
    bounds = _packing.current()
    cache = kwargs.get("cache", kwargs.get("cache_params", args[0] if args else None))
    if bounds is None or cache is not None or hidden_states.shape[0] != 1:
        return _original(self, state, hidden_states, *args, **kwargs)
    kwargs.pop("attention_mask", None)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                                                            "max_length_k", "position_ids")}
    # The torch fallback of transformers ignores cu_seqlens, so run each sequence on its own:
    # exact, and no recurrent or convolution state crosses a boundary.
    cu = bounds[0].tolist()
    outs = [_original(self, state, hidden_states[:, lo:hi], *args, **kwargs) for lo, hi in zip(cu[:-1], cu[1:])]
    return torch.cat(outs, dim=1)


# ----------------------------------------------------------------------------------- patch
def _install(module, fn, state):
    state.saved_forward = module.__dict__.get("forward")
    setattr(module, _ATTR, state)
    module.forward = types.MethodType(fn, module)


def _uninstall(module):
    state = module.__dict__.pop(_ATTR, None)
    if state is None:
        return
    if state.saved_forward is not None:
        module.forward = state.saved_forward
    else:
        module.__dict__.pop("forward", None)


def patch(model, *, remove_padding=True, ulysses_group=None):
    """Patch a loaded GLM/Qwen model instance for packed sequences and Ulysses sequence parallelism.

    Args:
        model: a ForConditionalGeneration / ForCausalLM / bare Model of a supported family.
        remove_padding: accept packed rows (one row, several sequences). With False, only
            Ulysses is applied (each rank's row is one sequence).
        ulysses_group: a ``torch.distributed`` process group for sequence parallelism, or None.

    Returns:
        a :class:`PatchRecord`. Patching twice is the same as patching once (a second call with
        other options re-patches).

    .. versionadded:: 0.1.0
    """
    config = getattr(model, "config", None)
    fam = _family(config if config is not None else model)
    existing = model.__dict__.get(_MODEL_ATTR)
    if existing is not None:
        if existing.remove_padding == remove_padding and existing._group is ulysses_group:
            return existing.record
        unpatch(model)
    from .config import rope_parameters, text_config

    resolutions = tuple(_resolve.resolve(kind, fam.name) for kind in ("rope.init", "rope.apply", "attention.signature"))
    rope_plan, plan = resolutions[1].plan, resolutions[2].plan
    module = resolutions[2].target
    section = rope_parameters(config).mrope_section if rope_plan.cos_rows == 3 else None
    attention_cls = getattr(module, fam.attention)
    text_cls = getattr(module, plan.text_model)
    linear_cls = getattr(module, plan.linear_attention) if plan.linear_attention else None

    world = 1
    if ulysses_group is not None:
        import torch.distributed as dist

        world = dist.get_world_size(ulysses_group)
        n_heads = text_config(config).num_attention_heads
        if n_heads % world:
            from .ulysses import UlyssesError

            raise UlyssesError(f"Ulysses: {n_heads} attention heads of {fam.name} do not divide over "
                               f"{world} ranks; choose a group size that divides {n_heads}")
        if linear_cls is not None:
            from .ulysses import UlyssesError

            raise UlyssesError(f"Ulysses: {fam.name} has linear-attention (Gated DeltaNet) layers whose recurrence "
                               f"runs along the sequence; they cannot be split by Ulysses; use ulysses_group=None")

    texts = [m for m in model.modules() if type(m) is text_cls]
    attentions = [m for m in model.modules() if isinstance(m, attention_cls)]
    linears = [m for m in model.modules() if linear_cls is not None and isinstance(m, linear_cls)]
    if not texts or not attentions:
        raise UnsupportedTransformersError(
            f"tfcompat.patch: found {len(texts)} {text_cls.__name__} and {len(attentions)} {attention_cls.__name__} "
            f"modules in {type(model).__name__}; pass a {fam.name} model built by transformers "
            f"{resolutions[0].transformers}"
        )

    def make_state(m):
        sig = inspect.signature(inspect.unwrap(type(m).forward))
        return _State(fam.name, plan, rope_plan, section, ulysses_group, world, sig, None)

    for m in texts:
        _install(m, _text_model_forward, make_state(m))
    if remove_padding or ulysses_group is not None:
        for m in attentions:
            _install(m, _attention_forward, make_state(m))
        for m in linears:
            _install(m, _linear_forward, make_state(m))
    record = PatchRecord(fam.name, text_cls.__name__, len(attentions), len(linears), remove_padding, world,
                         resolutions)
    model.__dict__[_MODEL_ATTR] = _ModelState(record, remove_padding, ulysses_group)
    return record


@dataclasses.dataclass
class _ModelState:
    record: PatchRecord
    remove_padding: bool
    _group: object


def unpatch(model):
    """Undo :func:`patch`: every patched module gets its original forward back. Returns True if it was patched."""
    state = model.__dict__.pop(_MODEL_ATTR, None)
    for m in model.modules():
        if _ATTR in m.__dict__ and isinstance(m.__dict__[_ATTR], _State):
            _uninstall(m)
    return state is not None
