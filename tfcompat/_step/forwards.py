"""The patched forwards, each a module-level function of ``(module, *args, **kwargs)`` installed by reference
(:data:`.patch.FORWARDS`): here the rotary module (hands the step to the layers on its output, checked once a step:
:func:`check_cos`), the decoder layers and the linear-attention mixers, which read only their arguments, the step and
what patch time bound; the attention's in :mod:`.._attention.attend`, the text model's in :mod:`.text`, the top
model's and the vision owner's in :mod:`.top`. ``attention_forward`` is also reachable here, where a model patched
and pickled by 0.3.0 names it.
"""

from __future__ import annotations

from .._attention.attend import attention_forward  # noqa: F401  (0.3.0's pickles name it here)
from .._probe import resolve as _resolve
from .._probe.families import family as family_of
from ..errors import PackingError, RopeShapeError, TfcompatError
from . import scope as _scope
from .install import (
    _ATTR,
    _CACHE_NAMES,
    _FLASH_KWARGS,
    _STEP,
    _carried,
    _lost_step,
    _original,
    _RotaryWithStep,
    _signature,
    _StepMask,
)


def rotary_forward(self, *args, **kwargs):
    state = getattr(self, _ATTR)
    out = _original(self, state, *args, **kwargs)
    step = _scope.running(state.owner)  # this model's step (not one another model runs around this call)
    if step is not None and isinstance(out, tuple):
        check_cos(state.family, *out)  # once per step: the per-layer rotation trusts this layout
        out = _RotaryWithStep(out)
        out.step, out.rotations = step, {}
    return out


def layer_forward(self, *args, **kwargs):
    state = getattr(self, _ATTR)
    pe = _carried(args, kwargs)
    if pe is None:
        if _scope.running(state.owner) is not None:  # a tripwire: the step's carrier was lost
            raise TfcompatError(
                f"tfcompat {state.family}: {type(self).__name__} did not receive the position embeddings of this "
                f"packed step, so it cannot tell where sequences begin; a wrapper or pre-hook around the decoder layer "
                f"that drops or rebuilds its arguments would do this (FSDP2's MixedPrecisionPolicy rebuilds them "
                f"unless cast_forward_inputs=False; for checkpointing wrap the layers with torch's checkpoint_wrapper "
                f"or tfcompat.enable_checkpointing); if nothing wraps it, this transformers release passes them "
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


# ------------------------------------------------------------------------ linear attention
def linear_forward(self, hidden_states, *args, **kwargs):
    import torch

    state = getattr(self, _ATTR)
    step, carrier = kwargs.pop(_STEP, None), None  # the layer's kwargs carry it (the interface route)
    if step is None:
        carrier = _scope.first((v for v in (*args, *kwargs.values()) if isinstance(v, _StepMask)), None)
        step = carrier.step if carrier is not None else None
    if step is None:
        if _scope.running(state.owner) is not None:  # a tripwire: the carrier was lost
            raise _lost_step(state, self, "the keyword arguments" if state.rides else "the attention mask")
        return _original(self, state, hidden_states, *args, **kwargs)
    args = tuple(None if v is carrier else v for v in args)
    cache = _scope.first((kwargs[n] for n in _CACHE_NAMES if kwargs.get(n) is not None), args[0] if args else None)
    if cache is not None or hidden_states.shape[0] != 1:
        raise PackingError(f"tfcompat {state.family}: the packed linear attention takes batch 1 and no cache")
    kwargs = {k: v for k, v in kwargs.items() if k not in _FLASH_KWARGS + ("position_ids", "attention_mask")}
    # The torch fallback of transformers ignores cu_seqlens, so run each sequence on its own:
    # exact, and no recurrent or convolution state crosses a boundary.
    b = step.bounds
    outs = [_original(self, state, hidden_states[:, lo:hi], *args, **kwargs) for lo, hi in zip(b[:-1], b[1:])]
    return torch.cat(outs, dim=1)


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
