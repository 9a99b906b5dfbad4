"""The first-use proof of the fused Triton RoPE kernel (:mod:`.rope_triton`): before a (device, dtypes, layout)
serves its first call in a process, a slice of that call's own tensors is rotated forward and back by the kernel
and by the composite on the same device (``table.first_use`` records and reports it)."""

import torch

from . import rope as kernels
from . import rope_triton as tr
from . import table


def proven(q, k, cos, sin, layout, seq_dim, inplace, rotation, gptj_cos, explicit):
    """First use proves the kernel (``table.first_use``): for this call's (device, dtypes, layout, widths, in place),
    once per process, a slice of the call's own tensors (one batch row, up to 8 tokens) is rotated forward and
    back by this kernel and by the composite, on the same device. False: ``auto`` falls back to the composite."""
    rows3 = cos.dim() == 4
    fast = ("rope", q.device, q.dtype, cos.dtype, layout.in_pairs, layout.out_pairs, layout.cos_mode, rows3, seq_dim,
            q.shape[-1], cos.shape[-1], bool(inplace))
    if table.passed(fast):  # proven earlier in this process: one set look-up a call
        return True

    key = (str(q.dtype)[6:], str(cos.dtype)[6:]) + fast[4:]
    n = min(8, q.shape[seq_dim])

    def piece():
        qs, ks = (t.detach()[:1].narrow(seq_dim, 0, n).clone() for t in (q, k))
        # cloned too: under inference_mode the caller's cos/sin are inference tensors, which autograd cannot save
        cs, ss = ((t.detach()[:, :1] if rows3 else t.detach()[:1]).narrow(-2, 0, n).clone() for t in (cos, sin))
        return qs, ks, cs, ss

    def both_ways(rotate, dtype=None):
        qs, ks, cs, ss = piece()
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
