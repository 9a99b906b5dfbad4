"""The first-use proof of the fused Triton RoPE kernel (:mod:`.fused`): before a (device, dtypes, layout)
serves its first call in a process, a slice of that call's own tensors is rotated forward and back by the kernel
and by the composite on the same device (``table.first_use`` records and reports it)."""

import torch

from .._kernels import table
from . import fused as tr
from . import native as kernels

#: tokens of a row the proof rotates (all of a shorter row): once per key and process, beside the composite
_TOKENS = 1024


def _piece(q, k, cos, sin, seq_dim, rows3):
    """The slice of a call a proof rotates, covering its structure: its first and last batch rows, every token up to
    _TOKENS (else the first and last _TOKENS / 2: a kernel wrong past some token, or for the last row, fails), every
    head of q and k, every channel (every mRoPE section); cos/sin rows and tokens selected with them, so each token
    keeps its own angles; cloned (under inference_mode the caller's cos/sin are inference tensors, which autograd
    cannot save)."""
    seq = q.shape[seq_dim]
    ti = torch.arange(seq, device=q.device)
    if seq > _TOKENS:
        ti = torch.cat((ti[:_TOKENS // 2], ti[-(_TOKENS // 2):]))
    ri = torch.tensor(sorted({0, q.shape[0] - 1}), device=q.device)
    qs, ks = (t.detach().index_select(0, ri).index_select(seq_dim, ti).clone() for t in (q, k))

    def pick(t):
        t = t.detach()
        batch_dim = 1 if rows3 else 0
        if t.shape[batch_dim] != 1:
            t = t.index_select(batch_dim, ri)
        return t.index_select(-2, ti).clone()

    return qs, ks, pick(cos), pick(sin)


def proven(q, k, cos, sin, layout, seq_dim, inplace, rotation, gptj_cos, explicit):
    """First use proves the kernel (``table.first_use``): for this call's (device, dtypes, layout, widths, in place),
    once per process, a slice of the call's own tensors (the first and last batch rows, up to 1,024 of their
    tokens, the first and the last, every head and channel) is rotated forward and back by this kernel and by the
    composite, on the same device. False: ``auto`` falls back to the composite (an empty call is served by the
    composite, unproven)."""
    rows3 = cos.dim() == 4
    fast = ("rope", q.device, q.dtype, cos.dtype, layout.in_pairs, layout.out_pairs, layout.cos_mode, rows3, seq_dim,
            q.shape[-1], cos.shape[-1], bool(inplace))
    if table.passed(fast):  # proven earlier in this process: one set look-up a call
        return True

    key = (str(q.dtype)[6:], str(cos.dtype)[6:]) + fast[4:]
    if q.numel() == 0 or k.numel() == 0:
        return False  # an empty call proves nothing (a kernel that writes zeros would pass): the composite serves it

    def both_ways(rotate, dtype=None):
        qs, ks, cs, ss = _piece(q, k, cos, sin, seq_dim, rows3)  # built inside: a failed key reaches here on every call
        if dtype is not None:
            qs, ks = qs.to(dtype), ks.to(dtype)
        with torch.no_grad():
            fq, fk = rotate(qs.clone(), ks.clone(), cs, ss, inplace)
        with torch.enable_grad():
            qg, kg = qs.requires_grad_(True), ks.requires_grad_(True)
            oq, ok = rotate(qg * 1, kg * 1, cs, ss, False)
            # the same gradient values into both backwards: the piece itself (in each path's dtype)
            gq, gk = torch.autograd.grad((oq, ok), (qg, kg), (qs.detach().to(oq.dtype), ks.detach().to(ok.dtype)))
        return fq, fk, gq, gk

    def run():
        before = tr.launches
        try:
            return both_ways(lambda a, b, c, s, ip: tr.rope(a, b, c, s, layout, seq_dim, inplace=ip))
        finally:  # counted apart: ``launches`` counts the calls' own launches
            tr.proof_launches += tr.launches - before
            tr.launches = before

    def reference():  # the composite in fp32 on the same values (cos/sin first cast to q's dtype, as the kernel)
        def composite(a, b, c, s, ip):
            if rows3:
                c, s = kernels.fold_contiguous(c, layout.section), kernels.fold_contiguous(s, layout.section)
            c, s = c.to(q.dtype).float(), s.to(q.dtype).float()
            return kernels.compact(a, b, c, s, rotation, gptj_cos, 1 if seq_dim == 2 else 2)
        return both_ways(composite, torch.float32)

    return table.first_use("rope", "triton", q.device, key, run, reference, explicit, fast)
