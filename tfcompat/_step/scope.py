"""The one carrier of a call's packed-step facts down the model: a thread-local stack of typed entries.

* :class:`CallBoundaries`: the boundaries a call named (the flash-attn keyword arguments the model ``patch()`` was given
  took out of upstream's call, handed to its text model);
* :class:`Packed`: ``tfcompat.packing.packed(cu, max_len)``, boundaries for every patched call in the block;
* :class:`RunningStep`: the packed step being run, and the model it belongs to (the rotary module hands it to the
  layers on its output; the layers read it from their own arguments, this entry is only a tripwire for a layer that
  lost it).

The layers never read this stack: what they need rides in their call's arguments (a checkpoint's recomputation
replays them).
"""

from __future__ import annotations

import threading

#: the flash-attn keyword arguments that name a packed row's boundaries (transformers' own names)
FLASH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")

_local = threading.local()


class CallBoundaries:
    __slots__ = ("kwargs",)

    def __init__(self, kwargs):
        self.kwargs = kwargs


class Packed:
    """``packing.packed(cu)``'s entry; ``read`` counts the patched text models of this copy that took the boundaries
    (the block refuses to end unread: a model patched by another copy of tfcompat, or by none, ran the row as one
    sequence)."""

    def __init__(self, cu, max_len):
        self.cu, self.max_len = cu, max_len
        self.read = 0


class TowersZero:
    """A text-only VL step traced by torch.compile: the towers' zero term, added by the text model to its input
    embeddings (a forward hook on the embedding cannot be traced)."""

    __slots__ = ("zero",)

    def __init__(self, zero):
        self.zero = zero


class RunningStep:
    """A text model's packed step, and the token ``patch()`` gave every patched module of that model (``owner``): a
    patched model called inside the step (from a hook on a layer) is another owner's, and runs its own call."""

    __slots__ = ("step", "owner")

    def __init__(self, step, owner):
        self.step, self.owner = step, owner


def _stack():
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def innermost(kind):
    """The innermost entry of ``kind`` on this thread, or None."""
    for entry in reversed(getattr(_local, "stack", ()) or ()):
        if isinstance(entry, kind):
            return entry
    return None


def packed_boundaries():
    """The innermost ``packing.packed(cu)`` entry on this thread, counted as read by the caller (a patched text
    model deciding its step), or None."""
    entry = innermost(Packed)
    if entry is not None:
        entry.read += 1
    return entry


def call_entry():
    """The innermost CallBoundaries or RunningStep entry (what the call being run was handed), or None."""
    for entry in reversed(getattr(_local, "stack", ()) or ()):
        if not isinstance(entry, (Packed, TowersZero)):
            return entry
    return None


def named():
    """The boundaries the enclosing call named (a dict), or None where the innermost call entry is not theirs."""
    entry = call_entry()
    return entry.kwargs if isinstance(entry, CallBoundaries) else None


def running(owner):
    """The packed step this thread runs for the model whose modules hold ``owner`` (their state's token), or None:
    none runs, or the innermost is another model's. A tripwire too: a layer or mixer of that model called without
    the step's carrier inside it lost it (the step itself rides the call's arguments below the text model)."""
    entry = call_entry()
    return entry.step if isinstance(entry, RunningStep) and entry.owner is owner else None


class carry:
    """``with carry(entry):`` the entry is innermost on this thread inside the block."""

    def __init__(self, entry):
        self.entry = entry

    def __enter__(self):
        _stack().append(self.entry)
        return self.entry

    def __exit__(self, *exc):
        _stack().pop()


def first(values, default=None):
    """The first of ``values``, or ``default``: ``next(iter, default)`` does not trace on torch 2.7's dynamo (a
    graph break, or no graph under ``fullgraph=True``)."""
    for value in values:
        return value
    return default
