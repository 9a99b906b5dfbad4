"""Where a sequence starts in a row of text positions (transformers' rule: at each position 0), read two ways side
by side: eagerly, as Python lists with refusals (:func:`starts_of`, :func:`padded_starts`), and inside a region
torch.compile traces, by tensor ops with every check of values a device-side assertion (:func:`_assert`,
:func:`_traced_starts_of_positions`). tests/test_starts.py runs every row of up to five positions through both.
3-row mRoPE ids have one rule, read by both alike: :func:`at_origin`."""

from __future__ import annotations

from ..errors import PackingError


def restarts(positions):
    """Where one row of text positions restarts at 0 (transformers' rule: a sequence begins there), as a Python
    list that starts with 0, and the first token where the positions go down without restarting at 0 (None where
    none does). The one reading of boundaries from positions: ``cu_seqlens_from_position_ids`` and the patched
    model's step both call it, each saying a refusal its own way."""
    import torch

    down = torch.nonzero((positions[1:] < positions[:-1]) & (positions[1:] != 0)).flatten()
    if down.numel():
        return None, int(down[0]) + 1
    return [0] + (torch.nonzero(positions[1:] == 0).flatten() + 1).tolist(), None


def starts_of(ids, valid, what):
    """Python list of sequence starts in one row of text positions (transformers' rule: a sequence begins
    where the position is 0). Positions that go down without restarting at 0 are refused. Under torch.compile:
    :func:`_traced_starts_of_positions` (tests/test_starts.py runs every row through both)."""
    t = ids[valid] if valid is not None else ids
    if t.numel() == 0:
        return [0]
    starts, i = restarts(t)
    if i is not None:
        raise PackingError(
            f"tfcompat: {what} go down from {int(t[i - 1])} to {int(t[i])} at token {i} without restarting at 0; "
            f"a packed sequence must start at position 0 (pass cu_seq_lens_q, tfcompat.packing.packed(cu), or "
            f"4-row ids from tfcompat.packing.pack)"
        )
    return starts


def padded_starts(row, valid):
    """Where the real tokens of a row with padding restart at 0 (``[0]``: never after the first). Positions may go
    down under padding (generate()'s masked token in assisted decoding: ``[0 .. n-2, 0, 1]`` under ``[1 .. 1, 0,
    1]``): upstream runs such a row; only a restart of the real tokens at 0 marks a packed row. Under
    torch.compile: :func:`_traced_starts_of_positions` with ``valid``."""
    import torch

    t = row[valid]
    return [0] + (torch.nonzero(t[1:] == 0).flatten() + 1).tolist() if t.numel() else [0]


def at_origin(positions):
    """Bool (..., n): the tokens of mRoPE ids (the T/H/W rows on dim 0) at (0, 0, 0), the one place 3-row ids show
    where a sequence starts: upstream's get_rope_index puts each sequence's first token there and no other token
    (the temporal row goes down inside one sequence, so it marks nothing; tests/test_embeds.py holds the rule per
    release). Tensor ops only, so the eager reading (``_attention.boundaries``) and the traced one
    (``_attention.traced``) both read it here."""
    return (positions == 0).all(dim=0)


def _assert(ok, what):
    """A check of values inside a compiled region: no host read; a device-side assertion (raised at once on the
    CPU, by the next synchronising call on a GPU) whose message names tfcompat's check."""
    import torch

    message = f"tfcompat (checked inside torch.compile): {what}"
    if len(message) > ASSERT_MESSAGE_LIMIT:  # CUDA refuses the call itself: every compiled step would fail
        raise AssertionError(f"tfcompat: a device-side check's message is {len(message)} characters, over CUDA's "
                             f"{ASSERT_MESSAGE_LIMIT}: {message}")
    torch._assert_async(ok, message)


#: the longest message torch._assert_async takes on CUDA ("Message length must be smaller than 255", seen on an
#: H200, torch 2.11: every fullgraph-compiled packed step failed); the CPU takes any length
ASSERT_MESSAGE_LIMIT = 254


def _traced_starts_of_positions(t, valid=None):
    """Bool (n,): the tokens of one row of text positions that begin a sequence (the first token, and every real
    token at position 0 after a real token), by tensor ops; positions of real tokens that go down without
    restarting at 0 fail a device-side assertion. The eager twins: :func:`starts_of` (``valid`` None),
    :func:`padded_starts`."""
    import torch

    first = torch.arange(t.shape[0], device=t.device) == 0
    if valid is None:
        restart = (t == 0) & ~first
        prev = torch.cat((t[:1], t[:-1]))
        _assert(~((t < prev) & (t != 0)).any(),
                "the position ids go down without restarting at 0; a packed sequence must start at position 0 "
                "(pass cu_seq_lens_q, tfcompat.packing.packed(cu), or 4-row ids from tfcompat.packing.pack)")
        return first | restart
    seen = torch.cumsum(valid.to(torch.int64), 0) > 1  # a real token before this one
    return first | ((t == 0) & valid & seen)
