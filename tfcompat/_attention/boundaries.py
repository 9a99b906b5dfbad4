"""Where the sequences of a packed step begin: found once per step, from explicit first (``cu_seq_lens_q/k``,
``seq_idx``, :func:`tfcompat.packing.packed`), else the text row of the position ids; validated against the
mask, the positions and (VL) the image/video placeholders; and the equal-shard check of a Ulysses step.

The patched forwards (:mod:`.._step.top`, :mod:`.._step.text`) call these; the per-layer code reads the resulting
:class:`Step`. Its twin under torch.compile is :func:`.traced.traced_step`.
"""

from __future__ import annotations

import dataclasses

from .._probe import families as _families
from .._step.scope import first, packed_boundaries
from ..errors import PackingError, UlyssesError
from .starts import at_origin, padded_starts, starts_of

# what transformers' DataCollatorWithFlattening can emit beside position ids: consumed by the patched text model
# (validated once per step, turned into the step's boundaries), never forwarded where upstream misreads them


@dataclasses.dataclass(frozen=True)
class Step:
    """Boundaries of one packed step, validated once: the per-layer code reads Python ints from here."""

    cu: object            # int32 tensor (n + 1,) on the model's device; None in a traced step from positions
    bounds: tuple         # the same as Python ints; None in a traced step (torch.compile: no host read)
    max_len: int          # None in a traced step unless the call named it
    total: int
    #: a traced step's sequence number of every token (int64, (total,)): what its masked attention reads
    seq: object = None
    #: per-step values the layers compute once (context parallel: each rank's attention pieces)
    memo: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)


def make_step(cu, total, max_len=None, what="boundaries", max_len_k=None, tail=False):
    """``tail``: the last range is the padding a sequence-parallel row was given (not the caller's sequence)."""
    from .cu import check_cu_seqlens, check_longest

    bounds = check_cu_seqlens(cu, total, what)
    hint = "; pass both from the same collator"
    longest = check_longest(bounds, max_len, "tfcompat", "max_length_q is", hint, tail, f"{what} ")
    check_longest(bounds, max_len_k, "tfcompat", "max_length_k is", hint, tail, f"{what} ")
    import torch

    return Step(cu.to(torch.int32), bounds, longest, total)


def mask_valid(mask, n):
    """Bool (n,) of real tokens from a 2-D mask of one row, or None when every token is real."""
    if mask is None:
        return None
    if not hasattr(mask, "dim") or mask.dim() != 2 or mask.shape[-1] != n:
        return "other"
    valid = mask[0].bool()
    return None if bool(valid.all()) else valid


def positions_of(cu, total, device):
    """Position ids (1, total) that count from 0 in every sequence of ``cu`` (one sequence when None)."""
    import torch

    idx = torch.arange(total, device=device)
    if cu is None:
        return idx[None]
    cu = cu.to(device=device, dtype=torch.int64)
    seq = torch.searchsorted(cu[1:], idx, right=True).clamp(max=cu.numel() - 2)
    return (idx - cu[seq])[None]


def check_position_shape(family, position_ids, batch, local):
    """Position ids as upstream's rotary module reads them: (batch or 1, seq), or (3 or 4, batch or 1, seq); an
    mRoPE family's rotary module broadcasts (1, batch, seq) to its three rows (5.3+ generate() continuing from
    past_key_values passes those). The ids as the boundaries are read from: (1, b, n) broadcast to (3, b, n)."""
    if position_ids is None or not hasattr(position_ids, "dim"):
        return position_ids
    shape = tuple(position_ids.shape)
    if len(shape) == 3 and shape[0] == 1 and _families.FAMILIES[family].mrope != "none" and \
            shape[1] in (1, batch) and shape[-1] == local:
        return position_ids.expand(3, -1, -1)
    ok = (len(shape) == 2 and shape[0] in (1, batch)) or (len(shape) == 3 and shape[0] in (3, 4) and
                                                         shape[1] in (1, batch))
    if not ok or shape[-1] != local:  # float ids are fine: upstream's own get_rope_index returns them (omni)
        raise PackingError(
            f"tfcompat {family}: position_ids of shape {shape} for an input of batch {batch} "
            f"and {local} tokens; expected ids of shape ({batch}, {local}), or (3, {batch}, {local}) / "
            f"(4, {batch}, {local}) for mRoPE (text row first in 4-row ids); a (4, {local}) tensor lacks the batch "
            f"dimension: position_ids[:, None]")
    return position_ids


def text_row(position_ids):
    """The (batch, seq) text positions of 2-D or 4-row ids; None for 3-row mRoPE ids or none."""
    import torch

    if not isinstance(position_ids, torch.Tensor):  # (hasattr on a tensor does not trace on torch 2.7's dynamo)
        return None
    if position_ids.dim() == 2:
        return position_ids
    if position_ids.dim() == 3 and position_ids.shape[0] == 4:
        return position_ids[0]
    return None


def cu_from_seq_idx(seq_idx, batch, local):
    """cu_seqlens (int64, CPU) from transformers' ``seq_idx`` (each token's sequence number in the row)."""
    import torch

    if seq_idx.dim() != 2 or seq_idx.shape[0] != 1 or batch != 1 or seq_idx.shape[1] != local or \
            seq_idx.dtype.is_floating_point or seq_idx.device.type == "meta":
        raise PackingError(f"tfcompat: seq_idx of shape {tuple(seq_idx.shape)} ({seq_idx.dtype}, on "
                           f"{seq_idx.device}) for an input of batch {batch} and {local} tokens; expected (1, "
                           f"{local}) integers: one packed row, as DataCollatorWithFlattening(return_seq_idx=True) "
                           f"returns it")
    row = seq_idx[0].detach().cpu()
    step = row[1:] - row[:-1]
    if local and (int(row[0]) != 0 or bool(((step != 0) & (step != 1)).any())):
        raise PackingError(f"tfcompat: seq_idx must count sequences 0, 1, 2, ... in order, got {row.tolist()}")
    starts = torch.nonzero(step).flatten() + 1
    return torch.cat((torch.zeros(1, dtype=torch.int64), starts.to(torch.int64),
                      torch.tensor([local], dtype=torch.int64)))


def check_explicit_types(explicit):
    """The flattening collator's tensors are tensors with values (a list or a meta tensor: one clear error)."""
    import torch

    for key in ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx"):
        value = explicit.get(key)
        if value is not None and not isinstance(value, torch.Tensor):
            raise PackingError(f"tfcompat: {key} is a {type(value).__name__}; pass a 1-D integer tensor as "
                               f"transformers' DataCollatorWithFlattening returns it")
        if value is not None and value.device.type == "meta":
            raise PackingError(f"tfcompat: {key} is on the meta device and holds no values; pass it on the "
                               f"model's device (or the CPU)")


def explicit_cu(explicit):
    """The whole row's boundaries the call names (cu_seq_lens_q, else _k, else tfcompat.packing.packed), or None."""
    check_explicit_types(explicit)
    cu = explicit.get("cu_seq_lens_q")
    if cu is None:
        cu = explicit.get("cu_seq_lens_k")
    packed = packed_boundaries()  # read by this copy's patched model, whichever boundaries win
    if cu is None and packed is not None:
        cu = packed.cu
    return cu


def find_step(state, group, explicit, position_ids, mask, batch, local, device, cached=False):
    """The step's boundaries, or None for an input that is not packed (and no Ulysses group): eagerly (under
    torch.compile the text model asks :func:`.traced.traced_step`). ``cached``: the call carries a KV cache (read
    by the traced step only, where a row is not read eagerly)."""
    world = state.world * state.context_world if group is not None else 1
    total = local * world
    row = local
    if group is not None and state.slice_inputs:
        # the whole-row call: seq_idx numbers the tokens of the row every rank passed (the row before its padding
        # to the group's multiple, as cu_seq_lens end at it)
        whole = getattr(explicit.get("seq_idx"), "shape", ())
        row = int(whole[-1]) if len(whole) == 2 and 0 < int(whole[-1]) <= total else total
    cu, source, explicit = _given_cu(explicit, batch, row, device)
    if isinstance(mask, dict):
        # generate() with a static cache or a compiled step builds one mask per layer type (transformers 4.54+
        # for configs with layer_types): each says itself what attends to what, like a 4-D mask
        mask = first((m for m in mask.values() if m is not None), None)
    valid = mask_valid(mask, local)
    if cu is not None:
        return _step_of_cu(group, cu, source, explicit, position_ids, valid, batch, total, device)
    if position_ids is None:
        if group is not None:
            raise UlyssesError(f"tfcompat {state.family}: a Ulysses shard needs its position ids (each rank holds a "
                               f"slice, so positions cannot be counted locally); pass the sliced position_ids")
        return None
    if position_ids.dim() == 3 and position_ids.shape[0] == 4:
        text, kind = position_ids[0], "text row of the 4-row position ids"
    elif position_ids.dim() == 2:
        text, kind = position_ids, "position ids"
    elif position_ids.dim() == 3 and position_ids.shape[0] == 3:
        text, kind = None, "mrope"
    else:
        raise PackingError(f"tfcompat {state.family}: position_ids of shape {tuple(position_ids.shape)}; expected "
                           f"(batch, seq), (3, batch, seq) or (4, batch, seq) with the text row first")
    if batch != 1 or valid == "other":
        # rows whose every token is real (no mask, a mask of ones, or a mask of another shape that cannot say
        # otherwise) and whose positions restart hold several sequences: upstream would attend across them
        if mask is None or mask.dim() == 2:  # a 4-D mask says itself what attends to what
            _refuse_restarting_rows(position_ids, text, mask, batch, local)
        return None  # padded batch (or a 4-D mask): upstream's own path, exact
    return _step_of_positions(state, group, position_ids, text, kind, valid, total, device)


def _given_cu(explicit, batch, local, device):
    """The boundaries the call named (cu_seq_lens_q/k, seq_idx, tfcompat.packing.packed), checked against each
    other: (cu or None, where they came from, the explicit arguments that go with them)."""
    import torch

    cu = explicit.get("cu_seq_lens_q")
    if cu is None and explicit.get("cu_seq_lens_k") is not None:
        cu = explicit["cu_seq_lens_k"]
    check_explicit_types(explicit)
    if cu is not None and explicit.get("cu_seq_lens_k") is not None and \
            not torch.equal(explicit["cu_seq_lens_k"].cpu(), cu.cpu()):
        raise PackingError("tfcompat: cu_seq_lens_q and cu_seq_lens_k differ; packed training attends each "
                           "sequence to itself, so pass the same boundaries for both")
    source = "cu_seq_lens_q"
    seq_idx = explicit.get("seq_idx")
    if seq_idx is not None:
        from_idx = cu_from_seq_idx(seq_idx, batch, local)
        if cu is not None and not torch.equal(from_idx, cu.detach().to("cpu", torch.int64)):
            raise PackingError(f"tfcompat: seq_idx marks sequences at {from_idx.tolist()} but cu_seq_lens_q is "
                               f"{cu.tolist()}; pass both from the same collator")
        if cu is None:
            cu, source = from_idx.to(device), "seq_idx"
    packed = packed_boundaries()  # read by this copy's patched model, whichever boundaries win
    if cu is None and packed is not None:
        cu, max_len = packed.cu, packed.max_len
        source = "packing.packed(cu)"
        explicit = {"max_length_q": max_len}
    return cu, source, explicit


def _step_of_cu(group, cu, source, explicit, position_ids, valid, batch, total, device):
    """The step of named boundaries, checked against the row and its position ids (None: one sequence)."""
    import torch

    if batch != 1:
        raise PackingError(f"tfcompat: {source} describes one packed row, but the input has batch {batch}; "
                           f"pack the batch into one row (tfcompat.packing.pack)")
    if valid is not None:
        raise PackingError(f"tfcompat: {source} marks a packed row, but attention_mask has padding in it; "
                           f"drop the padding (tfcompat.packing.pack does) or pass no mask")
    tail = group is not None and int(cu[-1]) < total
    if tail:
        cu = torch.cat((cu.to(device), torch.tensor([total], dtype=cu.dtype, device=device)))  # padded tail
    step = make_step(cu.to(device), total, explicit.get("max_length_q"), source, explicit.get("max_length_k"), tail)
    text = text_row(position_ids)
    if text is None and group is None and position_ids is not None and position_ids.dim() == 3 and \
            position_ids.shape[0] == 3 and position_ids.shape[1] == 1:
        # 3-row mRoPE ids: every sequence starts at (0, 0, 0) (text or an image's first patch), and no other
        # token is there; one read of the row, as for text ids
        zero = at_origin(position_ids[:, 0])
        starts = [int(i) for i in torch.nonzero(zero).flatten().tolist()]
        if starts and starts[0] == 0 and starts != list(step.bounds[:-1]):
            raise PackingError(
                f"tfcompat: {source} puts sequence starts at {list(step.bounds[:-1])} but the mRoPE position "
                f"ids restart at (0, 0, 0) at {starts}; RoPE and attention would disagree about where "
                f"sequences begin; pass boundaries and position ids of the same packing")
    if text is not None and group is None:
        starts = starts_of(text[0], None, "position ids")
        if starts != list(step.bounds[:-1]):
            raise PackingError(
                f"tfcompat: {source} puts sequence starts at {list(step.bounds[:-1])} but the position ids "
                f"restart at 0 at {starts}; RoPE and attention would disagree about where sequences begin; "
                f"pass position ids that count from 0 in every sequence of {source} (as "
                f"DataCollatorWithFlattening and tfcompat.packing.pack build them)")
    if group is None and len(step.bounds) == 2:
        return None  # validated, and one sequence: upstream's own path is exact (as for position ids)
    return step


def _refuse_restarting_rows(position_ids, text, mask, batch, local):
    """Refuse a row of a batch (or a row beside a mask that cannot mark padding) whose every token is real and
    whose positions restart: several packed sequences upstream would attend across."""
    for row in range(batch):
        if mask is not None and mask.shape[-1] == local and not bool(mask[row].bool().all()):
            continue  # padding in this row: upstream masks it exactly
        if text is None:  # 3-row mRoPE ids: a token at (0, 0, 0) after the first starts a sequence
            restarts = bool(at_origin(position_ids[:, row])[1:].any())
        else:
            restarts = len(starts_of(text[row], None, "position ids")) > 1
        if restarts:
            found = "no mask" if mask is None else f"an attention_mask of shape {tuple(mask.shape)}"
            raise PackingError(
                f"tfcompat: row {row} of a batch of {batch} restarts its positions (several packed "
                f"sequences) with {found}; packed rows must be batch 1, with no mask or a mask of "
                f"(1, {local}) ones; pack the whole micro-batch into one row "
                f"(tfcompat.packing.pack) or pass cu_seq_lens_q")


def _step_of_positions(state, group, position_ids, text, kind, valid, total, device):
    """The step of one row's position ids (gathered over the sequence groups first), or None: one sequence."""
    import torch

    rows = text if text is not None else position_ids[:, 0]  # (1, n) text row, or (3, n) T/H/W rows
    if group is not None:
        from .._parallel.collectives import gather

        if valid is not None:
            raise UlyssesError(f"tfcompat {state.family}: a Ulysses shard with padding in attention_mask; pack the "
                               f"rows (tfcompat.packing.pack) and slice the packed row")
        split = state.split()
        rows = gather(rows.contiguous(), 1, split.get("group"), None, split.get("context_group"), 1.0)
    if text is None:
        # 3-row mRoPE ids: the temporal row repeats and even goes down inside one sequence (an image's
        # temporal positions can exceed the text after it), so it never marks boundaries. Only a token at
        # (0, 0, 0) after the first one shows that the row holds several sequences: refuse those.
        t = rows[:, valid] if valid is not None and group is None else rows
        zero = at_origin(t)
        if group is not None:  # slice_for_rank pads the row's end with zeros
            real = torch.nonzero(~zero).flatten()
            zero = zero[: int(real[-1]) + 1] if real.numel() else zero[:1]
        if bool(zero[1:].any()):
            raise PackingError(
                f"tfcompat: position ids of shape {tuple(position_ids.shape)} hold several packed sequences (a "
                f"token after the first sits at (0, 0, 0)), but 3-row mRoPE ids cannot mark where each begins; pass "
                f"4-row ids (tfcompat.packing.pack builds them), cu_seq_lens_q, or wrap the call in "
                f"tfcompat.packing.packed(cu_seqlens)")
        starts = [0]
    elif valid is not None and group is None:
        # a row with padding in its mask is upstream's own path (a padded batch of one, or generate()'s masked
        # token in assisted decoding: positions [0 .. n-2, 0, 1] under a mask [1 .. 1, 0, 1]), never a packed row:
        # upstream runs it. Only real tokens that restart at 0 (a packed row with padding) are refused below
        starts = padded_starts(rows[0], valid)
    else:
        starts = starts_of(rows[0], valid if group is None else None, kind)
    if len(starts) > 1 and valid is not None:
        raise PackingError(f"tfcompat: the {kind} restart at 0 (a packed row) but attention_mask has padding in "
                           f"the row; drop the padding (tfcompat.packing.pack does) or pass no mask")
    if len(starts) == 1 and group is None:
        return None  # one sequence: upstream's own path is exact
    bounds = starts + [total]
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    return Step(cu, tuple(bounds), max(b - a for a, b in zip(bounds[:-1], bounds[1:])), total)
