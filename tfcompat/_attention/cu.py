"""Packed-row boundaries as the kernels take them: validated once, read back as Python ints."""

import torch

from ..errors import PackingError


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int, what: str = "cu_seqlens") -> tuple[int, ...]:
    """Validate packed-sequence boundaries and return them as a tuple of Python ints (one host sync).

    ``cu_seqlens`` must be a 1-D integer tensor that starts at 0, strictly increases, and ends at
    ``total`` (the token count of the packed row).
    """
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or \
            cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
        shape = tuple(cu_seqlens.shape) if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__
        dtype = getattr(cu_seqlens, "dtype", None)
        raise PackingError(f"{what}: expected a 1-D integer tensor of at least 2 boundaries (0, ..., total), got "
                           f"{shape} of {dtype}")
    if cu_seqlens.device.type == "meta":
        raise PackingError(f"{what}: the boundaries are on the meta device and hold no values; pass them on the "
                           f"model's device (or the CPU)")
    bounds = tuple(int(x) for x in cu_seqlens.tolist())
    if bounds[0] != 0 or bounds[-1] != total:
        raise PackingError(f"{what}: boundaries run from {bounds[0]} to {bounds[-1]} but the row has {total} tokens; "
                           f"they must start at 0 and end at the token count")
    bad = next((i for i in range(1, len(bounds)) if bounds[i] <= bounds[i - 1]), None)
    if bad is not None:
        raise PackingError(f"{what}: boundaries must strictly increase, but {bounds[bad - 1]} is followed by "
                           f"{bounds[bad]} (position {bad} of {list(bounds)})")
    return bounds


def check_longest(bounds, given, who, name="max_seqlen", hint="", tail=False, of=""):
    """The longest sequence of ``bounds`` (without the last range where ``tail``: a sequence-parallel row's
    padding); a ``given`` longest (the caller's max_seqlen / max_length_q) must equal it. ``name``: how the
    refusal names the given value ("max_seqlen", "max_length_q is"). The one check of a named
    longest sequence: ``varlen_attention`` and the patched model's step both call it."""
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    real = max(lengths[:-1]) if tail else max(lengths)
    if given is not None and int(given) != real:
        shown = list(bounds[:-1] if tail else bounds)
        raise PackingError(f"{who}: {name} {int(given)} but the longest sequence of {of}{shown} has {real} "
                           f"tokens{hint}")
    return max(lengths)
