"""The kernel table's row, and the proof each GPU kernel gives on first use.

Every RoPE implementation and packed-attention kernel is a row (:class:`Impl`): the operation, its name, the
devices ``auto`` picks it on, the dtypes it serves there, its priority, whether it is a GPU kernel that must prove
itself before it serves, and the row's own ``available()``, call and proof, so no caller branches on a kernel's
name. The rows live beside each op's choice (``_rope.implementation``, ``_attention.kernel_choice``); ``choice``
reads them all for ``report``; :func:`pick` selects from them.

First use proves the kernel: the first time a GPU kernel would serve a (kernel, device, dtype, layout) in this
process, it runs once on a small slice of the real inputs beside the proven path (the composite RoPE, the exact
SDPA attention) on the same device, forward and backward, and the results are compared. Under ``auto`` a compile
error or a mismatch falls back to the proven path with one warning naming the kernel, the device and how to
report it; an explicit choice raises. The comparison syncs with the host once per key; after it, a proven key
costs one dictionary look-up a call. Pure tensor code: nothing here reads transformers.
"""

import contextlib
import functools
import importlib.util
import os
import threading
import time
import warnings
from typing import Callable, NamedTuple, Optional

__all__ = ["Impl", "installed", "torch_ships", "pick", "first_use", "passed", "proven", "forget", "blocked", "isolated",
           "say_once", "say_traced"]


class Impl(NamedTuple):
    """One row: what the kernel is, where ``auto`` picks it, and what it does there. The rows live beside their
    kernels' choice (``implementation.ROWS``, ``kernel_choice.ROWS``); :func:`choice.rows` reads both."""

    op: str  # "rope" or "varlen"
    name: str
    devices: tuple  # where ``auto`` may pick it ("*": every device)
    dtypes: Optional[tuple]  # the dtypes it serves under ``auto`` (None: every floating dtype)
    priority: int  # higher first
    gpu: bool  # a GPU kernel: proves itself on first use
    note: str
    dropout: bool = True  # serves attention dropout (torch's varlen_attn takes none)
    available: Callable[[], str] = lambda: ""  # why it cannot run on this machine ('' when it can), decided once
    call: Optional[Callable] = None  # the kernel's call (varlen GPU rows: the library function and its arguments)
    proof: Optional[Callable] = None  # its first-use proof (GPU rows)


def installed(package):
    """Whether a top-level package is installed (found on the path, not imported)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


@functools.lru_cache(maxsize=None)
def torch_ships(path):
    """Whether the installed torch has the file ``path`` (relative to its package), read without importing it."""
    spec = importlib.util.find_spec("torch")
    return bool(spec and spec.origin) and os.path.exists(os.path.join(os.path.dirname(spec.origin), path))


def pick(rows, kind, dtype, dropout):
    """The name of the first of ``rows`` (highest priority first) that serves (device kind, dtype name, dropout)
    and can run here (its ``available()``); every op's rows end in a "*" row."""
    for row in rows:
        if not ("*" in row.devices or kind in row.devices) or (row.dtypes and dtype not in row.dtypes):
            continue
        if (dropout and not row.dropout) or row.available():
            continue
        return row.name
    raise AssertionError(f"the kernel table has no fallback on {kind}")


# (op, name, device, key) -> {"ok", "max_abs_diff", "tolerance", "seconds", "error", "warned", "mode"}
_PROVEN: dict = {}
# callers' cheap keys of passed proofs: one set look-up a call once proven
_PASSED: set = set()
# re-entrant: a proof that reaches first_use again on its own thread (it never should: :func:`isolated`) finds its
# slot in _PROVING and takes the proven path instead of waiting on itself
_LOCK = threading.RLock()
_PROVING: set = set()

# |got - want| <= tol * max(1, max |want|) per output dtype, want computed in fp32 from the same inputs: a kernel
# that computes in fp32 and rounds once is within half an ulp of its output dtype (the bound: 2-4 ulps); a wrong
# channel, sign or row is off by the values' own size
_TOL = {"float32": 1e-5, "float64": 1e-10, "bfloat16": 2.0 ** -6, "float16": 2.0 ** -8}


def _compare(got, want, dtype):
    """(max |diff|, within tolerance, tolerance): one stacked reduction read once (the proof's one host sync)."""
    import torch

    tol = _TOL.get(str(dtype).replace("torch.", ""), _TOL["float32"])
    diffs, scales = [], []
    for g, w in zip(got, want):
        if g.shape != w.shape:
            raise AssertionError(f"outputs differ in shape: {tuple(g.shape)} vs {tuple(w.shape)}")
        if g.numel():
            diffs.append((g.float() - w.float()).abs().max())
            scales.append(w.float().abs().max())
    if not diffs:
        return 0.0, True, tol
    worst, scale = torch.stack((torch.stack(diffs).max(), torch.stack(scales).max())).tolist()
    return worst, worst <= tol * max(1.0, scale), tol


def first_use(op, name, device, key, run, reference, explicit, fast=None):
    """Whether kernel ``name`` may serve ``key`` on ``device``: proven now (first use in this process) or before.

    ``run()`` and ``reference()`` return tuples of tensors (outputs and gradients) of the kernel and of the proven
    path on a small slice. ``explicit``: the caller asked for this kernel by name: a failed proof raises a
    ``TfcompatError`` instead of falling back. ``fast``: the caller's cheap key, remembered when the proof passed
    (see :func:`passed`).

    The proof runs apart from the caller's autograd context (:func:`isolated`): under a checkpointed layer's
    saved-tensor hooks, a selective-checkpoint dispatch mode, autocast, ``no_grad`` or ``inference_mode`` it computes
    what it computes at top level. Where no proof can run (a compiled region, a CUDA graph capture: :func:`blocked`)
    nothing is recorded: ``auto`` takes the proven path for that call, an explicit choice raises saying to warm up."""
    from ..errors import TfcompatError

    slot = (op, name, str(device), key)
    record = _current(slot)
    if record is None:
        why = blocked(_compiling(), _capturing(device))
        if why:
            if explicit:
                raise TfcompatError(
                    f"tfcompat: the {name} {op} kernel has not proven itself on {device} for {key}, and no proof "
                    f"can run {why}. Warm up first: run one eager call with the same shapes and dtypes before "
                    f"compiling or capturing (it proves the kernel once per process), or use impl='auto'")
            return False  # the proven path serves this call; nothing is recorded, an eager call proves the kernel
        with _LOCK:
            if slot in _PROVING:  # re-entered by the proof itself: the proven path, nothing recorded
                return False
            record = _current(slot)
            if record is None:
                _PROVING.add(slot)
                try:
                    record = _prove(run, reference, device)
                finally:
                    _PROVING.discard(slot)
                _PROVEN[slot] = record
    if record["ok"]:
        if fast is not None:
            _PASSED.add(fast)
        return True
    what = (f"tfcompat: the {name} {op} kernel failed its first-use proof on {device} for {key}: "
            f"{record['error'] or 'max |diff| %.3g against the proven path' % record['max_abs_diff']}")
    if explicit:
        raise TfcompatError(f"{what}; nothing was computed with it. Use the proven path (impl='composite' for "
                            f"RoPE, or impl='auto', which falls back), and report this with `tfcompat report` and "
                            f"`tfcompat check --device {str(device).split(':')[0]}` output at the project's issues")
    if not record["warned"]:
        record["warned"] = True
        warnings.warn(f"{what}; falling back to the proven path for it in this process. Please report it with "
                      f"`tfcompat report` and `tfcompat check --device {str(device).split(':')[0]}` output",
                      RuntimeWarning, stacklevel=3)
    return False


def _current(slot):
    """The slot's record, or None where a proof is due: never proven, or failed under ``no_grad`` /
    ``inference_mode`` while this call trains (a training call proves it again, once)."""
    record = _PROVEN.get(slot)
    if record is not None and not record["ok"] and record["mode"] != _mode() == "grad":
        return None
    return record


def blocked(compiling, capturing):
    """Why no first-use proof may run now ('' when one may): pure, so the GPU-only case is tested on CPU. A proof
    reads its verdict on the host, which a compiled region cannot trace and which invalidates a CUDA graph
    capture."""
    if compiling:
        return "inside a region torch.compile traces"
    if capturing:
        return "while the stream captures a CUDA graph (torch.cuda.graph / make_graphed_callables)"
    return ""


def _capturing(device):
    import torch

    return str(device).startswith("cuda") and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _mode():
    import torch

    if torch.is_inference_mode_enabled():
        return "inference"
    return "grad" if torch.is_grad_enabled() else "no_grad"


def _keep(t):
    return t


@contextlib.contextmanager
def isolated(device):
    """The caller's autograd context set aside for a proof: grad mode on, inference mode off, autocast off, the
    saved-tensor hooks of a checkpointed region replaced by plain saving (a non-reentrant checkpoint would otherwise
    recompute the whole layer, and with it this first use, when the proof differentiates), and the dispatch modes of
    selective checkpointing suspended (they would record the proof's ops as the layer's own)."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    kind = torch.device(device).type
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.enable_grad())
        stack.enter_context(_disable_current_modes())
        for dev in {"cpu", kind}:
            stack.enter_context(torch.autocast(dev, enabled=False))
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_keep, _keep))
        yield


#: the messages :func:`say_once` said in this process
SAID: set = set()


def say_once(message, stacklevel=4):
    """One RuntimeWarning per message and process."""
    if message not in SAID:
        SAID.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)


def say_traced(message):
    """:func:`say_once` from code torch.compile traces: dynamo calls it once while tracing and keeps its result as
    a constant, so the warning costs no graph break (``fullgraph=True`` compiles; tests/test_compile.py)."""
    say_once(message)
    return True


# what torch.compiler.assume_constant_result sets (torch 2.7-2.13), without importing torch._dynamo (~2 s) here
say_traced._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _compiling():
    import torch

    return torch.compiler.is_compiling()


def _prove(run, reference, device):
    start = time.perf_counter()
    record = {"ok": False, "max_abs_diff": float("nan"), "tolerance": None, "seconds": 0.0, "error": None,
              "warned": False, "mode": _mode()}
    try:
        # under inference_mode (generation), no_grad or a checkpointed layer too: the proof's slices are ordinary
        # tensors (cloned inside), differentiated by their own graph
        with isolated(device):
            got = tuple(t.detach() for t in run())
            want = tuple(t.detach() for t in reference())
            record["max_abs_diff"], record["ok"], record["tolerance"] = _compare(got, want, got[0].dtype)
    except Exception as exc:  # a compile or launch error is a failed proof, with its reason
        record["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    record["seconds"] = round(time.perf_counter() - start, 4)
    return record


def proven():
    """What this process has proven (or found failing): one dict per (op, kernel, device, key)."""
    return [dict(op=op, kernel=name, device=device, key=key,
                 **{k: v for k, v in rec.items() if k not in ("warned", "mode")})
            for (op, name, device, key), rec in list(_PROVEN.items())]


def passed(fast):
    """The fast path: whether a caller's cheap key (plain tensors' device, dtypes, ints) passed its proof before."""
    return fast in _PASSED


def forget():
    """Drop every proof (tests; ``tfcompat.clear_cache``)."""
    with _LOCK:
        _PROVEN.clear()
        _PASSED.clear()
        _PROVING.clear()
