"""Which kernel serves a call, for every op: the kernel table's rows (``implementation.ROWS``, ``kernel_choice.ROWS``)
filtered by what this machine has, decided once per process. Pure environment reads: nothing of transformers, no
torch at import (``_probe.backends`` re-exports it, with each op's own reads, for ``report``)."""

from typing import Any

from .._attention import kernel_choice
from .._rope import implementation

__all__ = ["rows", "unavailable", "select"]

_OPS = {"rope": implementation, "varlen": kernel_choice}


def rows(op: str):
    """The table's rows for one operation ("rope", "varlen"), highest priority first."""
    return _OPS[op].ROWS


def unavailable(op: str, name: str) -> str:
    """Why a kernel of the table cannot run here ('' when it can): the row's own ``available()``."""
    return _OPS[op].BY_NAME[name].available()


def select(op: str, device: Any, dtype: Any = None, dropout: bool = False) -> str:
    """What ``auto`` runs for ``op`` ("rope", "varlen") on ``device`` with ``dtype``: the available row of the
    kernel table of highest priority that serves them. A GPU kernel then still proves itself on first use."""
    return _OPS[op].select(device, dtype, dropout)
