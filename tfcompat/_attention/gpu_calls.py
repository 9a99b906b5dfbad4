"""The calls tfcompat makes into GPU attention libraries, and those libraries' signatures kept as data.

Neither flash-attn nor a CUDA build of torch can run on the machines this project is developed and tested on, so
each call is a pure function of its inputs (``flash_call``, ``torch_call``: the positional arguments and keywords
handed to the library) and the tests bind it against the real signatures: the installed torch's
``torch.nn.attention.varlen.varlen_attn`` read live, and below, as data, the releases users install, read from
their public source:

- flash-attn 2.7.0-2.7.4.post1 and 2.8.0-2.8.3 (``flash_attn/flash_attn_interface.py``): one signature;
- flash-attn 3 (``hopper/flash_attn_interface.py``, imported as ``flash_attn_interface``, Hopper GPUs): a different
  one (``seqused_q`` in dropout's place, no dropout; ``return_attn_probs`` decides whether the log-sum-exp comes
  back too): called by its own convention (:func:`flash3_call`), never with flash-attn 2's;
- torch's ``varlen_attn`` as shipped in 2.13 (``enable_gqa`` needed for fewer kv heads) and as on a branch that
  has ``k_cache`` and no ``enable_gqa`` (kv heads shared by the flash kernel itself).

Conventions (each checked by a test against the functions' documented behaviour, or named as needing a GPU):

- positional order ``q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k``; everything else by keyword;
- ``cu_seqlens``: int32 on q's device (flash-attn's docstring: "dtype torch.int32");
- causal: flash-attn's ``causal=True``; torch's derives it from ``window_size == (-1, 0)`` (a tuple: a list
  compares unequal and would run non-causal);
- a sliding window of ``w`` keys (the query and the ``w - 1`` before it): ``window_size=(w - 1, 0)``: flash-attn
  attends keys ``[i + sk - sq - left, i + sk - sq + right]`` inclusive;
- GQA: flash-attn shares kv heads when ``heads % kv_heads == 0``; torch 2.13 requires ``enable_gqa=True`` for it;
- causal alignment is bottom-right when ``cu_q != cu_k`` (flash-attn's docstring); tfcompat passes equal ``cu``
  only (context-parallel pieces run SDPA), so that convention is proven only by ``bench/gpu_check.py`` on a GPU.
"""

import inspect
from typing import Any

__all__ = ["FLASH_ATTN_2", "FLASH_ATTN_3", "TORCH_VARLEN", "signature", "flash_call", "flash3_call", "first_output",
           "torch_call", "fits",
           "deterministic", "unfit_shapes"]

_P = inspect.Parameter


def signature(spec):
    """An ``inspect.Signature`` from recorded data: ``(positional names, {keyword: default} after them, keyword-only
    names)``."""
    positional, defaults, kwonly = spec
    params = [_P(n, _P.POSITIONAL_OR_KEYWORD) for n in positional]
    params += [_P(n, _P.POSITIONAL_OR_KEYWORD, default=d) for n, d in defaults.items()]
    params += [_P(n, _P.KEYWORD_ONLY, default=None) for n in kwonly]
    return inspect.Signature(params)


_VARLEN_HEAD = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")

#: flash-attn 2.7.x and 2.8.x ``flash_attn_varlen_func``: identical in all 20 tags v2.7.0 ... v2.8.3.post1
FLASH_ATTN_2 = {
    "releases": ("2.7.0", "2.7.0.post1", "2.7.0.post2", "2.7.1", "2.7.1.post1", "2.7.1.post2", "2.7.1.post3",
                 "2.7.1.post4", "2.7.2", "2.7.2.post1", "2.7.3", "2.7.4", "2.7.4.post1", "2.8.0", "2.8.0.post1",
                 "2.8.0.post2", "2.8.1", "2.8.2", "2.8.3", "2.8.3.post1"),
    "spec": (_VARLEN_HEAD, {"dropout_p": 0.0, "softmax_scale": None, "causal": False, "window_size": (-1, -1),
                            "softcap": 0.0, "alibi_slopes": None, "deterministic": False,
                            "return_attn_probs": False, "block_table": None}, ()),
}
#: flash-attn 3 (``flash_attn_interface.flash_attn_varlen_func``): seqused_q where 2.x has dropout_p, no dropout;
#: the same window and causal convention as 2.x (keys ``[i + sk - sq - left, i + sk - sq + right]``, bottom-right)
FLASH_ATTN_3 = {
    "releases": ("hopper/flash_attn_interface.py at commit 0251105a (2026-08)",),
    "spec": (_VARLEN_HEAD, {"seqused_q": None, "seqused_k": None, "softmax_scale": None, "causal": False, "qv": None,
                            "q_descale": None, "k_descale": None, "v_descale": None, "window_size": (-1, -1),
                            "attention_chunk": 0, "softcap": 0.0, "num_splits": 1, "pack_gqa": None,
                            "deterministic": False, "sm_margin": 0, "return_attn_probs": False}, ()),
}
_TORCH_HEAD = ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k")
#: torch's ``varlen_attn``: as shipped in 2.13.0, and the variant with a KV cache and no ``enable_gqa``
TORCH_VARLEN: dict[str, Any] = {
    "2.13": (_TORCH_HEAD, {}, ("return_aux", "scale", "window_size", "enable_gqa", "seqused_k", "block_table",
                               "num_splits")),
    # 2.14.1: the same keywords as 2.13 (read from its file, tox env torch214)
    "2.14": (_TORCH_HEAD, {}, ("return_aux", "scale", "window_size", "enable_gqa", "seqused_k", "block_table",
                               "num_splits")),
    # 2.15.0: the same names (read from its file, tox env tf525-torch215); cu_seq_k may be None (tfcompat passes
    # cu), causal is compared as a list (a tuple still works), and a backend is selected per call (cuDNN first)
    "2.15": (_TORCH_HEAD, {}, ("return_aux", "scale", "window_size", "enable_gqa", "seqused_k", "block_table",
                               "num_splits")),
    "kv-cache branch": (_TORCH_HEAD, {}, ("return_aux", "scale", "window_size", "k_cache", "v_cache",
                                          "cache_seqlens", "cache_batch_idx", "page_table", "seqused_k")),
}


def _window(causal, window):
    """flash-attn's (left, right): keys ``[i - left, i + right]``, -1 unbounded."""
    left = -1 if window is None else window - 1
    return (left, 0) if causal else (left, -1 if window is None else window - 1)


def flash_call(q, k, v, cu, max_len, *, causal, scale, window, dropout_p, deterministic=False):
    """``(args, kwargs)`` for flash-attn 2's ``flash_attn_varlen_func`` over one packed row (cu: int32, q's device).

    flash-attn's ``causal`` is separate from its window: causal without a window is ``(-1, -1)``.
    ``deterministic``: flash-attn's deterministic backward, as transformers passes it (:func:`deterministic`)."""
    win = (-1, -1) if window is None else _window(causal, window)
    return (q, k, v, cu, cu, max_len, max_len), dict(dropout_p=dropout_p, softmax_scale=scale, causal=causal,
                                                   window_size=win, deterministic=deterministic)


def flash3_call(q, k, v, cu, max_len, *, causal, scale, window, deterministic=False):
    """``(args, kwargs)`` for flash-attn 3's ``flash_attn_varlen_func`` (no dropout: its row serves none). The seven
    leading positionals as 2.x; ``return_attn_probs=False`` said aloud (older builds return ``(out, lse)`` whatever
    it says: :func:`first_output` takes the output)."""
    win = (-1, -1) if window is None else _window(causal, window)
    return (q, k, v, cu, cu, max_len, max_len), dict(softmax_scale=scale, causal=causal, window_size=win,
                                                   deterministic=deterministic, return_attn_probs=False)


def first_output(result):
    """The attention output of a kernel that may also return its log-sum-exp (flash-attn 3 builds differ)."""
    return result[0] if isinstance(result, tuple) else result


def deterministic():
    """transformers' rule for flash-attn's ``deterministic``: ``FLASH_ATTENTION_DETERMINISTIC=1``, or torch's
    deterministic algorithms switched on (``torch.use_deterministic_algorithms(True)``)."""
    import os

    import torch

    return os.environ.get("FLASH_ATTENTION_DETERMINISTIC", "0") == "1" or torch.are_deterministic_algorithms_enabled()


#: the largest head_dim flash-attn 2's kernels and torch's varlen_attn compile for
MAX_HEAD_DIM = 256


def unfit_shapes(q, k, v):
    """Why the GPU varlen kernels cannot take these heads ('' when they can): both need v's head_dim equal to q's
    and at most 256. The exact SDPA path serves such calls, with nothing to report (not a failed proof)."""
    if v.shape[-1] != q.shape[-1]:
        return f"v head_dim {v.shape[-1]} differs from q's {q.shape[-1]}"
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head_dim {q.shape[-1]} is over {MAX_HEAD_DIM}"
    return ""


def torch_call(q, k, v, cu, max_len, *, causal, scale, window, params):
    """``(args, kwargs)`` for torch's ``varlen_attn``: causal is ``window_size == (-1, 0)`` there (a tuple);
    ``params``: the keyword names the installed function takes (``enable_gqa`` only where it exists)."""
    kwargs = dict(scale=scale, window_size=_window(causal, window))
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = q.shape[1] != k.shape[1]
    return (q, k, v, cu, cu, max_len, max_len), kwargs


_FLASH_NEEDS = ("dropout_p", "softmax_scale", "causal", "window_size", "deterministic")
_FLASH3_NEEDS = ("softmax_scale", "causal", "window_size", "deterministic", "return_attn_probs")
_TORCH_NEEDS = ("scale", "window_size")


def source_signature(path, name):
    """The signature of function ``name`` defined in the Python file ``path``, read without importing it (torch's
    varlen module imports torch._dynamo: seconds that ``report`` need not pay); None where it is not found."""
    import ast

    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
    except (OSError, SyntaxError, ValueError):
        return None
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if fn is None:
        return None
    a = fn.args
    positional = [x.arg for x in a.posonlyargs + a.args]
    n_default = len(a.defaults)
    head = positional[:len(positional) - n_default]
    defaults = {x: None for x in positional[len(positional) - n_default:]}
    return signature((tuple(head), defaults, tuple(x.arg for x in a.kwonlyargs)))


#: the keywords each kernel's call passes, by the row's name
_NEEDS = {"flash_attn": _FLASH_NEEDS, "flash_attn_3": _FLASH3_NEEDS, "torch_varlen": _TORCH_NEEDS}


def fits(fn, kind):
    """Why tfcompat's call does not fit ``fn``'s real signature ('' when it does): the seven leading positional
    parameters and the keywords the call passes. ``kind``: "flash_attn", "flash_attn_3" or "torch_varlen"."""
    try:
        sig = fn if isinstance(fn, inspect.Signature) else inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        return f"its signature cannot be read ({exc})"
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 7 or any(p.default is not _P.empty for p in positional[:7]):
        return f"it does not take the 7 leading positional arguments (q, k, v, cu_q, cu_k, max_q, max_k): {sig}"
    names = {p.name for p in params[7:] if p.kind != _P.VAR_POSITIONAL}
    needs = _NEEDS[kind]
    missing = [n for n in needs if n not in names]
    if missing:
        return f"it takes no {', '.join(missing)} keyword (signature {sig})"
    return ""
