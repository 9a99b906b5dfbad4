"""The first-use proof of the GPU packed-attention kernels (flash-attn's and torch's varlen kernels), beside
``rope_proof`` for the RoPE kernel: once per (kernel, device, dtype, heads, head_dim, causal, window) in a process,
a piece of the call's own tensors runs through the kernel and the exact SDPA path, forward and backward
(``table.first_use``); after it, one set look-up a call (``passed``)."""

from . import table

__all__ = ["passed", "passed_before_tracing", "proven"]

def _fast(kind, q, k, causal, window):
    return ("varlen", kind, q.device, q.dtype, q.shape[1], k.shape[1], q.shape[2], bool(causal), window)


def passed(kind, q, k, causal, window):
    """Whether this (kernel, device, dtype, heads, head_dim, causal, window) passed its first-use proof: the
    per-call check, one set look-up."""
    return table.passed(_fast(kind, q, k, causal, window))


def passed_before_tracing(kind, device, dtype, heads, kv_heads, head_dim, causal, window):
    """:func:`passed` from code torch.compile traces, by plain values (the tensors' device, dtype and sizes): dynamo
    calls it once while tracing and keeps the answer as a constant of the graph, so a kernel proven before
    compiling (an eager call, ``tfcompat.warmup``) is called as the op it is registered as, with no guard on the
    proof table. A kernel first proven after the graph was built serves the next graph built."""
    return table.passed(("varlen", kind, device, dtype, heads, kv_heads, head_dim, bool(causal), window))


# what torch.compiler.assume_constant_result sets (torch 2.7-2.13), without importing torch._dynamo here
passed_before_tracing._dynamo_marked_constant = True  # type: ignore[attr-defined]


def proven(kind, call, reference, q, k, v, causal, scale, window):
    """First use proves a GPU attention kernel (``table.first_use``): for this (kernel, device, dtype, heads,
    head_dim, causal, window), once per process, a piece of the call's own q, k, v (two sequences: 16 tokens, and
    one 16 longer than the window; every head) runs through ``call(q, k, v, cu, max_len)`` and through
    ``reference(q, k, v, bounds)`` (the exact SDPA path, in fp32), forward and backward. False: the caller runs the
    reference path instead."""
    import torch

    fast = _fast(kind, q, k, causal, window)
    if table.passed(fast):  # proven earlier in this process: one set look-up a call
        return True
    key = (str(q.dtype)[6:],) + fast[4:]
    if q.shape[0] == 0:
        return False  # an empty call proves nothing: the exact path serves it, nothing is recorded
    # two sequences: a short one, and one longer than the window by 16 keys (so a kernel that ignores the window,
    # or counts it off by one, differs); every head of q, k and v. A row shorter than that is repeated to reach it:
    # the key proven here serves later calls with longer sequences
    n = 16 + (32 if window is None else window + 16)
    bounds = [0, 16, n]

    def both_ways(fn, dtype):
        # built here, inside the proof: a key that failed its proof reaches proven() on every call
        take = torch.arange(n, device=q.device) % q.shape[0]
        grad_out = torch.randn((n, q.shape[1], v.shape[-1]), generator=torch.Generator().manual_seed(0))
        # copies: the caller's tensors may be inference tensors (a rollout), which cannot require gradients
        pieces = [t.detach().index_select(0, take).to(dtype, copy=True).requires_grad_(True) for t in (q, k, v)]
        with torch.enable_grad():
            out = fn(*pieces)
            # the output's own shape (v's head_dim), the same values into both backwards
            grads = torch.autograd.grad(out, pieces, grad_out.to(device=out.device, dtype=out.dtype))
        return (out, *grads)

    def run():
        cu = torch.tensor(bounds, dtype=torch.int32, device=q.device)
        longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        return both_ways(lambda a, b, c: call(a, b, c, cu, longest), q.dtype)

    def ref():
        return both_ways(lambda a, b, c: reference(a, b, c, bounds), torch.float32)

    return table.first_use("varlen", kind, q.device, key, run, ref, False, fast)
