"""The step under torch.compile: decided from the call's shapes, never from values, with every check of values
a device-side assertion naming tfcompat's check (no host read inside a compiled region). The eager rules are in
:mod:`.boundaries`; the text model asks here while torch.compile traces."""

from __future__ import annotations

from .._step.scope import first, packed_boundaries
from ..errors import PackingError, UlyssesError
from .boundaries import Step, check_explicit_types, cu_from_seq_idx, text_row
from .starts import _assert, _traced_starts_of_positions, at_origin


def _traced_cu(explicit, batch, local):
    """The named boundaries (cu_seq_lens_q/k, tfcompat.packing.packed) of a traced call, checked on the device;
    (cu or None, source)."""
    import torch

    check_explicit_types(explicit)
    cu_q, cu_k = explicit.get("cu_seq_lens_q"), explicit.get("cu_seq_lens_k")
    cu, source = (cu_q, "cu_seq_lens_q") if cu_q is not None else (cu_k, "cu_seq_lens_k")
    max_len = explicit.get("max_length_q", explicit.get("max_length_k"))
    packed = packed_boundaries()  # read by this copy's patched model, whichever boundaries win
    if cu is None and packed is not None:
        cu, source, max_len = packed.cu, "packing.packed(cu)", packed.max_len
    if cu is None:
        return None, None, None
    if cu.dim() != 1 or cu.numel() < 2 or cu.dtype.is_floating_point or cu.dtype == torch.bool:
        check_cu_values(cu, local, source)  # the eager refusal names the found shape and dtype
    if cu_q is not None and cu_k is not None:
        if cu_q.shape != cu_k.shape:
            raise PackingError("tfcompat: cu_seq_lens_q and cu_seq_lens_k differ; packed training attends each "
                               "sequence to itself, so pass the same boundaries for both")
        _assert((cu_q.to(cu_k.device, torch.int64) == cu_k.to(torch.int64)).all(),
                "cu_seq_lens_q and cu_seq_lens_k differ; pass the same boundaries for both")
    steps = cu[1:] - cu[:-1]
    ok = (cu[0] == 0) & (cu[-1] == local) & (steps > 0).all()
    for key in ("max_length_q", "max_length_k"):
        given = explicit.get(key) if source != "packing.packed(cu)" else (max_len if key == "max_length_q" else None)
        if given is not None:
            ok = ok & (steps.max() == given)
    _assert(ok, f"{source} must run from 0 to the row's {local} tokens, strictly increasing, its longest sequence "
                f"equal to max_length_q/k; pass both from one collator")
    return cu, source, max_len


def check_cu_values(cu, total, what):
    from .cu import check_cu_seqlens

    return check_cu_seqlens(cu, total, what)


def traced_step(state, group, explicit, position_ids, mask, batch, local, device, cached=False):
    """:func:`find_step` inside a region torch.compile traces (``model.compile(fullgraph=True)``): decided from
    what the call passes (its shapes), never from values, with every check of values a device-side assertion.

    * boundaries named (cu_seq_lens_q/k, seq_idx, tfcompat.packing.packed) or one row of text position ids with
      no attention_mask: a packed step whose attention is one masked SDPA call (one sequence is a packed step of
      one: the same numbers as upstream's causal attention);
    * anything else (a padded batch, a mask, 3-row mRoPE ids): upstream's own path, with the eager path's
      refusal of rows that would hold several packed sequences as a device-side assertion (a packed row beside an
      attention_mask is refused under compile: pass it without the mask, as DataCollatorWithFlattening does)."""

    if group is not None:
        raise UlyssesError(
            f"tfcompat {state.family}: a Ulysses or context-parallel step inside a region torch.compile traces "
            f"(its boundaries are gathered over the group and its attention exchanges heads); compile the decoder "
            f"layers instead (layer.compile(), the FSDP2 recipe), which tfcompat supports with sequence groups")
    if isinstance(mask, dict):
        mask = first((m for m in mask.values() if m is not None), None)
    cu, source, max_len = _traced_cu(explicit, batch, local)
    seq_idx = explicit.get("seq_idx")
    text = text_row(position_ids)
    if cu is not None or seq_idx is not None:
        return _traced_named(cu, source or "seq_idx", max_len, seq_idx, text, position_ids, mask, batch, local, device)
    return _traced_positions(state, text, position_ids, mask, batch, local, device, cached)


def _traced_named(cu, name, max_len, seq_idx, text, position_ids, mask, batch, local, device):
    """:func:`traced_step` where the call names the boundaries (``name``: cu_seq_lens_q/k, seq_idx or
    tfcompat.packing.packed): the step, its agreement with the mask and the position ids asserted on the device
    (the eager twin: :func:`.boundaries.find_step`)."""
    import torch

    if batch != 1:
        raise PackingError(f"tfcompat: {name} describes one packed row, but the input has batch "
                           f"{batch}; pack the batch into one row (tfcompat.packing.pack)")
    if mask is not None and getattr(mask, "dim", lambda: 0)() == 2:
        _assert(mask.bool().all(), f"{name} marks a packed row, but attention_mask has padding "
                                   f"in it; drop the padding (tfcompat.packing.pack does) or pass no mask")
    idx = torch.arange(local, device=device)
    if seq_idx is not None:
        if seq_idx.dim() != 2 or tuple(seq_idx.shape) != (1, local) or seq_idx.dtype.is_floating_point:
            cu_from_seq_idx(seq_idx, batch, local)  # its refusal, with the found shape
        row = seq_idx[0].to(device=device, dtype=torch.int64)
        d = row[1:] - row[:-1]
        _assert((row[0] == 0) & ((d == 0) | (d == 1)).all(), "seq_idx must count sequences 0, 1, 2, ... in "
                                                             "order")
        seq = row
        if cu is not None:
            from_cu = torch.searchsorted(cu[1:].to(device=device, dtype=torch.int64), idx, right=True)
            _assert((from_cu == seq).all(), "seq_idx and cu_seq_lens_q mark different sequences; pass both "
                                            "from the same collator")
    else:
        seq = torch.searchsorted(cu[1:].to(device=device, dtype=torch.int64), idx, right=True)
    if text is not None and text.shape[0] == 1:
        starts = torch.cat((torch.ones(1, dtype=torch.bool, device=device), seq[1:] != seq[:-1]))
        _assert((starts == _traced_starts_of_positions(text[0].to(device))).all(),
                f"{name} and the position ids put sequence starts at different tokens; pass "
                f"position ids counting from 0 in every sequence (DataCollatorWithFlattening's)")
    elif position_ids is not None and position_ids.dim() == 3 and position_ids.shape[0] == 3 and \
            position_ids.shape[1] == 1:
        starts = torch.cat((torch.ones(1, dtype=torch.bool, device=device), seq[1:] != seq[:-1]))
        zero = at_origin(position_ids[:, 0].to(device))
        _assert(~zero[0] | (zero == starts).all(),
                f"{name} and the mRoPE position ids (restarting at (0, 0, 0)) put sequence "
                f"starts at different tokens; pass boundaries and position ids of the same packing")
    cu32 = cu.to(device=device, dtype=torch.int32) if cu is not None else None
    # the longest sequence as the call named it (an int, or the SymInt dynamo makes of it once it varies):
    # what a GPU varlen kernel takes in the graph (forwards._attend_row)
    named = max_len if isinstance(max_len, (int, torch.SymInt)) and not isinstance(max_len, bool) else None
    return Step(cu32, None, named, local, seq=seq)


def _traced_positions(state, text, position_ids, mask, batch, local, device, cached):
    """:func:`traced_step` from the position ids alone: one row of text ids with no mask is a packed step; anything
    else runs upstream's path, a row holding several sequences refused on the device."""
    import torch

    if position_ids is None:
        return None
    if position_ids.dim() == 3 and position_ids.shape[0] == 3:
        if mask is None or getattr(mask, "dim", lambda: 0)() == 2:
            zero = at_origin(position_ids)[:, 1:].any(-1)  # (batch,): a token after the first at (0, 0, 0)
            if mask is not None:
                zero = zero & mask.bool().all(-1)
            _assert(~zero.any(), "3-row mRoPE position ids hold several packed sequences (a token after the first "
                                 "sits at (0, 0, 0)) but cannot mark where each begins; pass 4-row ids "
                                 "(tfcompat.packing.pack builds them) or cu_seq_lens_q")
        return None
    if text is None:
        raise PackingError(f"tfcompat {state.family}: position_ids of shape {tuple(position_ids.shape)}; expected "
                           f"(batch, seq), (3, batch, seq) or (4, batch, seq) with the text row first")
    if batch == 1 and mask is None and not cached:
        starts = _traced_starts_of_positions(text[0].to(device))
        return Step(None, None, None, local, seq=torch.cumsum(starts.to(torch.int64), 0) - 1)
    if mask is None or mask.dim() == 2:
        # upstream's own path: a row whose positions restart at 0 after a real token holds several sequences,
        # which upstream would attend across (the eager path packs a batch-1 row whose mask is all ones)
        valid = mask.bool() if mask is not None and mask.shape[-1] == local else \
            torch.ones(text.shape, dtype=torch.bool, device=text.device)
        seen = torch.cumsum(valid.to(torch.int64), -1) > 1
        restarts = ((text == 0) & valid & seen).any(-1)
        if cached:  # decoding (or a prefill that fills a cache): upstream's path, as eagerly
            _assert(~restarts.any(), "position ids restart at 0 (a packed row) in a call with a KV cache or "
                                     "use_cache; packed sequences cannot share a cache: pass use_cache=False and no "
                                     "past_key_values")
        else:
            _assert(~restarts.any(), "position ids restart at 0 (a packed row) beside an attention_mask or in a "
                                     "batch of rows; compiled, pass a packed row alone, with no attention_mask "
                                     "(DataCollatorWithFlattening's), or cu_seq_lens_q")
    return None
