"""Native rotary kernels: every convention apply_rope covers, with an analytic backward.

Notation, for one tensor ``x`` of rotary width ``rd`` (the leading ``rd`` channels of the
last dim; the rest passes through):

    a, b = the two rotated parts of x:
        "neox": a = x[..., :rd/2],   b = x[..., rd/2:rd]   (GPT-NeoX halves, ``rotate_half``)
        "gptj": a = x[..., 0:rd:2],  b = x[..., 1:rd:2]    (GPT-J adjacent pairs)
    out_a = a * c1 - b * s1
    out_b = b * c2 + a * s2

which is exactly ``x * cos + rotate(x) * sin`` of the upstream functions, with (c1, s1)
and (c2, s2) the parts of cos/sin that meet a and b. The backward is the inverse
rotation, so nothing of size x is saved:

    da = ga * c1 + gb * s2
    db = gb * c2 - ga * s1

The work runs in slices along the sequence so that each slice's intermediates stay in
cache: the tensor crosses memory about once per direction, not once per elementwise op.
"""

import torch

# Elements of x handled per slice: big enough to amortize dispatch, small enough for L2.
_SLICE_ELEMENTS = 1 << 18


def _slices(length, per_row):
    step = max(1, _SLICE_ELEMENTS // max(1, per_row))
    return [(i, min(i + step, length)) for i in range(0, length, step)]


def _parts(x, rotation, rd):
    if rotation == "neox":
        half = rd // 2
        return x[..., :half], x[..., half:rd]
    return x[..., 0:rd:2], x[..., 1:rd:2]


def _rotate_into(out_a, out_b, a, b, c1, s1, c2, s2):
    torch.mul(a, c1, out=out_a)
    out_a.addcmul_(b, s1, value=-1)
    torch.mul(b, c2, out=out_b)
    out_b.addcmul_(a, s2)


def _run(x, out, trig, rotation, rd, seq_dim, inverse=False):
    """Rotate ``x`` into ``out`` (may be ``x`` itself), slice by slice along ``seq_dim``."""
    c1, s1, c2, s2 = trig
    length = x.shape[seq_dim]
    per_row = x.numel() // max(1, length)
    for lo, hi in _slices(length, per_row):
        xs = x.narrow(seq_dim, lo, hi - lo)
        os_ = out.narrow(seq_dim, lo, hi - lo)
        parts = [t.narrow(seq_dim, lo, hi - lo) if t.shape[seq_dim] != 1 else t for t in (c1, s1, c2, s2)]
        a, b = _parts(xs, rotation, rd)
        oa, ob = _parts(os_, rotation, rd)
        if out is x:
            a = a.clone()  # out_b needs the old a after out_a overwrote it
        if inverse:
            pc1, ps1, pc2, ps2 = parts
            # da = ga*c1 + gb*s2 ; db = gb*c2 - ga*s1  (the same kernel with (s1, s2) swapped and negated)
            _rotate_into(oa, ob, a, b, pc1, -ps2, pc2, -ps1)
        else:
            _rotate_into(oa, ob, a, b, *parts)
        if out is not x and rd < x.shape[-1]:
            os_[..., rd:].copy_(xs[..., rd:])


def trig_parts(cos, sin, rotation, gptj_cos):
    """(c1, s1, c2, s2) and the rotary width for folded, unsqueezed cos/sin."""
    if rotation == "neox":
        rd = cos.shape[-1]
        half = rd // 2
        return (cos[..., :half], sin[..., :half], cos[..., half:], sin[..., half:]), rd
    if gptj_cos == "half":
        # upstream: cos[..., :rd/2].repeat_interleave(2); pair i meets cos[i]
        rd = cos.shape[-1]
        c, s = cos[..., : rd // 2], sin[..., : rd // 2]
        return (c, s, c, s), rd
    rd = cos.shape[-1]
    return (cos[..., 0::2], sin[..., 0::2], cos[..., 1::2], sin[..., 1::2]), rd


class _Rope(torch.autograd.Function):
    """Out-of-place rotation; backward = inverse rotation (saves only cos/sin)."""

    @staticmethod
    def forward(ctx, x, c1, s1, c2, s2, rotation, rd, seq_dim):
        out = torch.empty_like(x)
        _run(x, out, (c1, s1, c2, s2), rotation, rd, seq_dim)
        ctx.save_for_backward(c1, s1, c2, s2)
        ctx.meta = (rotation, rd, seq_dim)
        return out

    @staticmethod
    def backward(ctx, grad):
        rotation, rd, seq_dim = ctx.meta
        grad_in = torch.empty_like(grad)
        _run(grad, grad_in, ctx.saved_tensors, rotation, rd, seq_dim, inverse=True)
        return grad_in, None, None, None, None, None, None, None


class _RopeInplace(torch.autograd.Function):
    """In-place rotation of ``x`` (marked dirty); backward = inverse rotation."""

    @staticmethod
    def forward(ctx, x, c1, s1, c2, s2, rotation, rd, seq_dim):
        _run(x, x, (c1, s1, c2, s2), rotation, rd, seq_dim)
        ctx.mark_dirty(x)
        ctx.save_for_backward(c1, s1, c2, s2)
        ctx.meta = (rotation, rd, seq_dim)
        return x

    @staticmethod
    def backward(ctx, grad):
        rotation, rd, seq_dim = ctx.meta
        grad_in = torch.empty_like(grad)
        _run(grad, grad_in, ctx.saved_tensors, rotation, rd, seq_dim, inverse=True)
        return grad_in, None, None, None, None, None, None, None


def _composite(x, c1, s1, c2, s2, rotation, rd):
    """Plain differentiable form, used when cos/sin themselves need gradients."""
    a, b = _parts(x, rotation, rd)
    out_a = a * c1 - b * s1
    out_b = b * c2 + a * s2
    if rotation == "neox":
        rot = torch.cat((out_a, out_b), dim=-1)
    else:
        rot = torch.stack((out_a, out_b), dim=-1).flatten(-2)
    return torch.cat((rot, x[..., rd:]), dim=-1) if rd < x.shape[-1] else rot


def rotate(x, trig, rotation, rd, seq_dim, inplace=False):
    c1, s1, c2, s2 = trig
    if any(t.requires_grad for t in trig):
        # cos/sin need gradients: let autograd differentiate the plain form (out of place)
        return _composite(x, c1, s1, c2, s2, rotation, rd)
    fn = _RopeInplace if inplace else _Rope
    return fn.apply(x, c1, s1, c2, s2, rotation, rd, seq_dim)


def fold_contiguous(cos, section):
    """Qwen2-VL / GLM-4V mRoPE: (3, b, s, rd) -> (b, s, rd), T/H/W blocks of ``section`` (twice)."""
    split = list(section) * 2
    return torch.cat([m[i % 3] for i, m in enumerate(cos.split(split, dim=-1))], dim=-1)
