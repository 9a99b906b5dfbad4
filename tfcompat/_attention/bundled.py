"""The bundled attention forward: tfcompat's own attention body, for the attention modules whose packed step upstream's
attention forward does not serve (``_State.carrier == "forward"``; the ``attention.carrier`` resolution and the
model's implementation decide at patch time):

* Qwen2-VL and Qwen2.5-VL on transformers 4.51-4.52, whose attention classes call their kernels themselves (no
  ``ALL_ATTENTION_FUNCTIONS``), and the 4.x families whose decoder layers do not hand the attention its kwargs;
* a model loaded with an implementation whose function reads the module's own config (flash attention on 5.x),
  which the interface route's config copy would change;
* ``TFCOMPAT_ROPE_IMPL``: tfcompat's own rotation kernel asked for by name.

``patch`` binds :func:`bundled_forward` on each such module's state; :func:`.attend.attention_forward` runs it with
the call both routes share (the whole row's bound kernel, or Ulysses' / context's slice). Built on the rotation
``tfcompat.rope.apply_rope`` runs (:class:`.._rope.implementation.Rotation`). Dropping these routes drops this module.
"""

from __future__ import annotations

from .._probe import resolve as _resolve
from .._probe.families import family as family_of
from .._rope.implementation import Rotation, chosen_impl
from ..errors import PackingError


def bundled_forward(self, state, pe, hidden, attend_row, attend_split):
    """A packed step's attention, tfcompat's own body: projections, q/k norms, the gated query, the rotation of the
    step's (cos, sin) prepared once for all layers (:func:`for_layers`), the call over (tokens, heads, dim) q/k/v that
    the interface route runs too (``attend_row``, or ``attend_split`` where the model was patched with a Ulysses or
    context group), the output gate and projection, and the return arity the release's decoder layer unpacks (the
    ``attention.signature`` plan, probed at patch time). The checks of the call are its own: one row (batch 1), and
    the process group where the model was patched with one (on the interface route the text model checked both once
    for the step). They are written inline, not called: this body runs in every layer, where each Python call counts."""
    import torch

    if hidden.shape[0] != 1:
        raise PackingError(f"tfcompat {state.family}: the packed attention needs batch 1, got batch {hidden.shape[0]}")
    if state.group_lost:
        state.group_or_raise()
    step = pe.step
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
    if state.group is not None or state.context_group is not None:
        out = attend_split(state, step, q, k, v, scale, dropout)
    else:
        out = attend_row(step, q, k, v, scale, state.window, dropout)
    out = out.reshape(1, s, -1)
    if gate is not None:
        out = out * torch.sigmoid(gate)
    out = self.o_proj(out)
    return (out, None, None) if plan.returns == 3 else (out, None)


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
    per step, :func:`.._step.forwards.check_cos`), the sections and the ``rope.apply`` resolution bound at patch
    time."""
    fam = family_of(model_type)
    res = resolution if resolution is not None else _resolve.resolve("rope.apply", fam.name)
    return Rotation(q, k, cos, sin, fam.name, res, 2, 1, mrope_section, False, chosen_impl(None))(q, k)
