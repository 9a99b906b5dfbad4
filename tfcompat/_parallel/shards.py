"""Sequence-parallel shards (Ulysses, context parallel, both): every rank's slice checked alike on every rank of
the mesh, the whole row's call sliced after embedding (``slice_inputs=True``), and a slice's positions from the
whole row's boundaries. Once per step; the patched text and VL forwards call these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from .._attention.boundaries import explicit_cu, positions_of, text_row
from .._step.scope import first
from ..errors import PackingError, UlyssesError

if TYPE_CHECKING:
    import torch


def _fingerprint(inputs, position_ids):
    """Two numbers that differ between a rank's slice and its neighbour's (weighted sums of the ids, or of the
    first embedding channel, and of the positions); equal on every rank only when every rank holds one row."""
    import torch

    n = inputs.shape[1]
    w = torch.arange(1, n + 1, dtype=torch.float64, device=inputs.device)
    first = inputs[0] if inputs.dim() == 2 else inputs[0, :, 0]
    pos = position_ids.reshape(-1, n).to(torch.float64) @ w if position_ids is not None and \
        position_ids.shape[-1] == n else torch.zeros(1, dtype=torch.float64, device=inputs.device)
    return torch.stack(((first.detach().to(torch.float64) @ w), pos.sum()))


def check_shards(state, groups, local, batch, inputs=None, position_ids=None, whole=False, named=False):
    """:func:`check_ulysses_lengths` over each of the model's sequence groups, decided alike on every rank of
    their mesh: on a 2-D mesh (context x Ulysses) one group can see a problem its crossing groups cannot, so a
    one-float all-reduce over each group carries any refusal to every rank (none would wait in a collective for
    a peer that stopped). ``named``: the call names the whole row's boundaries (their length is checked)."""
    import torch
    import torch.distributed as dist

    groups = list(groups)
    errors = [check_ulysses_lengths(local, batch, g, state, inputs, position_ids, whole, named, raise_=False)
              for g in groups]
    mine = first((e for e in errors if e is not None), None)
    if len(groups) > 1:
        flag = torch.tensor([0.0 if mine is None else 1.0], device=inputs.device if inputs is not None else None)
        if dist.get_backend(groups[0]) == "nccl":
            flag = flag.cuda()
        for g in groups:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=g)
        if mine is None and float(flag) > 0:
            mine = UlyssesError(f"tfcompat {state.family}: another rank of the sequence-parallel mesh refused this "
                                f"step (its error says why); every rank stops with it")
    if mine is not None:
        raise mine


def check_ulysses_lengths(local, batch, group, state, inputs=None, position_ids=None, whole=False, named=False,
                          raise_=True):
    """Every rank holds an equal slice (or, with ``whole``, the same whole row); one small collective per step.
    ``named``: the call names the whole row's boundaries, whose length tells a slice from a whole row (slices
    of equal content, e.g. the same sequence twice, are no mistake then). Without ``raise_``, the error is
    returned (None when there is none)."""
    try:
        _check_ulysses_lengths(local, batch, group, state, inputs, position_ids, whole, named)
    except UlyssesError as exc:
        if raise_:
            raise
        return exc
    return None


def _check_ulysses_lengths(local, batch, group, state, inputs, position_ids, whole, named):
    import torch
    import torch.distributed as dist

    from .collectives import all_gather

    if batch != 1:
        raise UlyssesError(f"tfcompat {state.family}: Ulysses needs one packed row per rank (batch 1), got batch "
                           f"{batch}; pack the micro-batch (tfcompat.packing.pack) before slicing it")
    mine = torch.tensor([float(local)], dtype=torch.float64, device=inputs.device if inputs is not None else None)
    if inputs is not None:
        mine = torch.cat((mine, _fingerprint(inputs, position_ids).to(mine.device)))
    if dist.get_backend(group) == "nccl":
        mine = mine.cuda()
    seen = all_gather(mine, group)  # equal shapes on every rank
    lengths = [int(x[0]) for x in seen]
    if len(set(lengths)) != 1:
        what = "the whole row" if whole else "an equal slice"
        raise UlyssesError(f"tfcompat {state.family}: Ulysses ranks hold {lengths} tokens; every rank must hold "
                           f"{what}; " + ("pass the same packed row on every rank (patched with slice_inputs=True)"
                                          if whole else "cut the row with tfcompat.ulysses.slice_for_rank (it pads "
                                                        "the end)"))
    if inputs is None or len(seen) < 2:
        return
    same = all(torch.equal(seen[0], x) for x in seen[1:])
    if whole and not same:
        raise UlyssesError(f"tfcompat {state.family}: the model was patched with slice_inputs=True, so every rank "
                           f"passes the whole packed row and the model keeps its own slice; the ranks passed "
                           f"different rows of {local} tokens; pass the same row (ids, positions, pixels) on every "
                           f"rank, or patch without slice_inputs and pass each rank's slice")
    if not whole and same and not named:
        raise UlyssesError(f"tfcompat {state.family}: every Ulysses rank passed the same {local} tokens and "
                           f"positions: a whole row, not this rank's slice, so no rank would split the work; "
                           f"patch with tfcompat.patch(model, ulysses_group=group, slice_inputs=True) to pass the "
                           f"whole row (the model slices it after embedding, as verl's VLM call expects), or cut "
                           f"the row per rank (tfcompat.ulysses.slice_for_rank / slice_inputs)")


def slice_whole_row(module, state, given, explicit):
    """``slice_inputs=True``: the text model got the whole packed row on every rank (verl's VLM call); embed it
    (if ids) and keep this rank's slice of the embeddings, positions and Qwen3-VL's vision rows."""
    embeds = given.get("inputs_embeds")
    if embeds is None:
        embeds = module.get_input_embeddings()(given["input_ids"])
    batch, total = embeds.shape[:2]
    position_ids = given.get("position_ids")
    if position_ids is None:
        cu = explicit.get("cu_seq_lens_q", explicit.get("cu_seq_lens_k"))
        position_ids = positions_of(cu, total, embeds.device)
    if position_ids.shape[-1] != total:
        raise UlyssesError(f"tfcompat {state.family}: position ids of shape {tuple(position_ids.shape)} for a whole "
                           f"row of {total} tokens; pass the whole row's positions on every rank")
    mask = given.get("attention_mask")
    if mask is not None and hasattr(mask, "dim") and mask.dim() == 2 and not bool(mask.bool().all()):
        raise UlyssesError(f"tfcompat {state.family}: a whole row with padding in attention_mask; pack the rows "
                           f"(tfcompat.packing.pack) and pass the packed row with no mask")
    check_shards(state, state.split().values(), total, batch, embeds, position_ids, whole=True)
    extra = {k: given.get(k) for k in ("visual_pos_masks", "deepstack_visual_embeds") if given.get(k) is not None}
    local = slice_inputs(embeds, position_ids, **state.split(), **extra)
    given.update(local, input_ids=None, attention_mask=None)
    if "cache_position" in given:
        given["cache_position"] = None  # upstream counts it from the slice
    return given


def shard_positions(state, explicit, position_ids, local, device, rows=2):
    """A sequence-parallel shard (this rank's slice of one packed row) with the whole row's boundaries: the
    slice of the positions counted from 0 in every sequence of them (the flattening collator's
    ``return_position_ids=False`` output, sliced), in ``rows`` rows (2: ``(1, local)``, 3: mRoPE's ``(3, 1,
    local)``); given positions are checked against them instead. The positions as the call should have them
    (None when the call names no boundaries)."""
    import torch

    from .collectives import slice_for_rank

    cu = explicit_cu(explicit)
    if cu is None:
        return position_ids
    if explicit.get("seq_idx") is not None:
        raise PackingError(f"tfcompat {state.family}: seq_idx on a sequence-parallel shard: this rank's slice of it "
                           f"cannot say where the whole row's sequences begin; pass the whole row's "
                           f"cu_seq_lens_q/cu_seq_lens_k (or this rank's slice of its position ids) instead")
    if cu.dim() != 1 or cu.numel() < 2 or cu.dtype.is_floating_point:
        return position_ids  # make_step names what is wrong with it
    split = state.split()
    n = int(cu[-1])
    index = slice_for_rank(torch.arange(n, device=device)[None], dim=1, pad_value=-1, **split)
    if index.shape[-1] != local:
        raise PackingError(f"tfcompat {state.family}: cu_seq_lens_q ends at {n} tokens: that row, sliced over the "
                           f"sequence-parallel ranks (tfcompat.ulysses.slice_for_rank), gives {index.shape[-1]} "
                           f"tokens per rank, but this rank holds {local}; pass the boundaries of the row you "
                           f"sliced")
    want = slice_for_rank(positions_of(cu, n, device), dim=1, **split)
    if position_ids is None:
        return want if rows == 2 else want[None].expand(3, 1, local)
    text = text_row(position_ids)
    real = index[0] >= 0
    if text is not None and not torch.equal(text[0][real].to(want.dtype), want[0][real]):
        raise PackingError(f"tfcompat {state.family}: this rank's position ids do not count from 0 in every "
                           f"sequence of cu_seq_lens_q {cu.tolist()} (its slice of them is {want[0].tolist()}, "
                           f"given {text[0].tolist()}); RoPE and attention would disagree about where sequences "
                           f"begin; slice the positions of the same packing, or pass none (tfcompat builds them "
                           f"from cu_seq_lens_q)")
    return position_ids


def slice_inputs(inputs_embeds: torch.Tensor, position_ids: torch.Tensor, *,
                 visual_pos_masks: Optional[torch.Tensor] = None, deepstack_visual_embeds: Optional[list] = None,
                 group: Any = None, context_group: Any = None) -> Any:
    """This rank's share of a packed row, for the text decoder stack of a patched model.

    Args:
        inputs_embeds: (1, total, hidden), e.g. from :func:`tfcompat.embeds.get_input_embeds` on the full row.
        position_ids: (1, total), or (3 or 4, 1, total).
        visual_pos_masks, deepstack_visual_embeds: Qwen3-VL's mask of vision tokens (1, total) and the
            per-layer features of those tokens (num_visual, hidden); each rank keeps the rows of the
            vision tokens that fall in its slice.

    Returns:
        a dict with the same keys, sliced (padded at the end to a multiple of the group size), ready to
        pass as keyword arguments to the text model. Gradients flow back to the full tensors. With
        ``context_group`` (instead of ``group``): this rank's two chunks of the context-parallel layout.
    """
    import torch

    from .collectives import slice_for_rank as _slice

    which = {"group": group, "context_group": context_group}
    out: dict[str, Any] = {
        "inputs_embeds": _slice(inputs_embeds, dim=1, **which),
        "position_ids": _slice(position_ids, dim=position_ids.dim() - 1, **which),
    }
    if visual_pos_masks is not None:
        out["visual_pos_masks"] = _slice(visual_pos_masks, dim=1, pad_value=False, **which)
        if deepstack_visual_embeds is not None:
            # the rows of the vision tokens this rank holds, in its order: index them by their place among
            # the row's vision tokens (each token's rank among them, sliced like the row)
            order = torch.cumsum(visual_pos_masks.to(torch.int64), dim=1) - 1
            mine = _slice(order, dim=1, pad_value=-1, **which)[out["visual_pos_masks"]]
            out["deepstack_visual_embeds"] = [d.index_select(0, mine) for d in deepstack_visual_embeds]
    return out
