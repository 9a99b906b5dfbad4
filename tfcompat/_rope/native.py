"""Native rotary kernels: every convention apply_rope covers, with an analytic backward.

Tuned for CPU: many small in-cache ops over slices of the sequence (300-1,800 dispatched ops per
call at 16k tokens). On a GPU each op is a kernel launch, so ``apply_rope`` sends CUDA tensors to the
fused Triton kernel (``fused.py``) or to ``compact`` below; the GPT-J probe here (``torch.equal``)
would also sync with the host there.

Notation, for one tensor ``x`` of rotary width ``rd`` (the leading ``rd`` channels of the
last dim; the rest passes through untouched):

    a, b = the two rotated parts of x:
        "neox": a = x[..., :rd/2],   b = x[..., rd/2:rd]   (GPT-NeoX halves, ``rotate_half``)
        "gptj": a = x[..., 0:rd:2],  b = x[..., 1:rd:2]    (GPT-J adjacent pairs)
    out_a = a * c1 - b * s1
    out_b = b * c2 + a * s2

which is ``x * cos + rotate(x) * sin`` of the upstream functions, with (c1, s1) and
(c2, s2) the parts of cos/sin that meet a and b. The backward is the inverse rotation,
so nothing of the size of x is saved:

    da = ga * c1 + gb * s2
    db = gb * c2 - ga * s1

GPT-J pairs with c1 == c2 and s1 == s2 (always, for cos/sin from a rotary module) are a
complex multiplication by ``c + i s``: one pass over memory (fp32/fp64), or three
in-cache passes through fp32 for bf16/fp16. Half-precision NeoX slices are also computed
in fp32 in cache and written back once.

Every kernel walks the sequence in slices of ~64k elements so that a slice's
intermediates stay in L2: the big tensor crosses main memory about once per direction
instead of once per elementwise op. Output allocation (page faults of fresh memory) is
the rest of the cost; the in-place variant has none.
"""

import torch

# Elements of x per slice (1 MiB of fp32): big enough that per-op dispatch stays small next to
# the work, small enough that a slice, its output and the temporaries stay in L2/L3.
_SLICE_ELEMENTS = 1 << 18


def complex_viewable(x):
    """Whether adjacent pairs of x's last dim can be viewed as complex numbers (torch.view_as_complex's rule)."""
    return x.stride(-1) == 1 and x.storage_offset() % 2 == 0 and all(s % 2 == 0 for s in x.stride()[:-1])


class Trig:
    """cos/sin prepared once per call: broadcastable to x, split into the parts each kernel needs."""

    def __init__(self, cos, sin, rotation, gptj_cos):
        # cos, sin: folded and unsqueezed, e.g. (b, 1, s, rd); same dtype as x
        self.rotation = rotation
        self.rd = cos.shape[-1]
        if rotation == "neox":
            h = self.rd // 2
            self.parts = (cos[..., :h], sin[..., :h], cos[..., h:], sin[..., h:])
        elif gptj_cos == "half":
            # upstream: cos[..., :rd/2].repeat_interleave(2), so pair i meets cos[i]
            c, s = cos[..., : self.rd // 2], sin[..., : self.rd // 2]
            self.parts = (c, s, c, s)
        else:
            self.parts = (cos[..., 0::2], sin[..., 0::2], cos[..., 1::2], sin[..., 1::2])
        c1, s1, c2, s2 = self.parts
        self.freqs = None
        if rotation == "gptj" and (c1 is c2 or (torch.equal(c1, c2) and torch.equal(s1, s2))):
            self.freqs = torch.complex(c1.float(), s1.float()) if c1.dtype != torch.float64 else torch.complex(c1, s1)
        self._half_parts()
        self._inverse = None

    def _half_parts(self):
        """Half-precision x is computed through fp32 in cache: its cos/sin parts in fp32, made once here."""
        half = self.parts[0].dtype in (torch.bfloat16, torch.float16) and self.freqs is None
        self.parts32 = tuple(p.float() for p in self.parts) if half else self.parts

    def inverse(self):
        if self._inverse is None:
            inv = Trig.__new__(Trig)
            inv.rotation, inv.rd, inv._inverse = self.rotation, self.rd, self
            c1, s1, c2, s2 = self.parts
            # da = ga*c1 + gb*s2 ; db = gb*c2 - ga*s1: the forward kernel with s1 <- -s2, s2 <- -s1
            inv.parts = (c1, -s2, c2, -s1)
            inv.freqs = None if self.freqs is None else self.freqs.conj().resolve_conj()
            inv._half_parts()
            self._inverse = inv
        return self._inverse


def _run(x, out, trig, seq_dim):
    """Rotate x into out (out may be x), slice by slice along seq_dim. Written without helper calls or generator
    expressions: it runs twice per layer (q and k) in every patched attention."""
    rd, rotation = trig.rd, trig.rotation
    length = x.shape[seq_dim]
    step = max(1, _SLICE_ELEMENTS // max(1, x.numel() // max(1, length)))
    inplace = out is x
    fast = trig.freqs is not None
    native_complex = fast and x.dtype in (torch.float32, torch.float64)
    half_x = x.dtype in (torch.bfloat16, torch.float16)
    parts, freqs = trig.parts32 if half_x else trig.parts, trig.freqs
    h = rd // 2
    for lo in range(0, length, step):
        n = min(step, length - lo)
        if n == length:  # one slice: the whole tensor (the usual case below 64k elements per position)
            xs, os_, f = x, out, freqs
            c1, s1, c2, s2 = parts
        else:
            xs, os_ = x.narrow(seq_dim, lo, n), out.narrow(seq_dim, lo, n)
            c1, s1, c2, s2, f = [t if t is None or t.shape[seq_dim] == 1 else t.narrow(seq_dim, lo, n)
                                 for t in (*parts, freqs)]
        if not inplace and rd < x.shape[-1]:
            os_[..., rd:].copy_(xs[..., rd:])
        if native_complex:
            torch.mul(torch.view_as_complex(xs[..., :rd].unflatten(-1, (h, 2))), f,
                      out=torch.view_as_complex(os_[..., :rd].unflatten(-1, (h, 2))))
            continue
        if fast:
            # bf16/fp16 pairs: through fp32 in cache (one rounding instead of upstream's three)
            t = xs[..., :rd].float()
            torch.view_as_complex(t.unflatten(-1, (h, 2))).mul_(f)
            os_[..., :rd].copy_(t)
            continue
        src = xs[..., :rd].float() if half_x else xs
        if rotation == "neox":
            a, b, oa, ob = src[..., :h], src[..., h:rd], os_[..., :h], os_[..., h:rd]
        else:
            a, b, oa, ob = src[..., 0:rd:2], src[..., 1:rd:2], os_[..., 0:rd:2], os_[..., 1:rd:2]
        if half_x:
            # half precision: compute the slice in fp32 in cache (faster than half-precision ops on
            # CPU, and one rounding instead of upstream's three), then write it back once
            ra = a * c1
            ra.addcmul_(b, s1, value=-1)
            rb = b * c2
            rb.addcmul_(a, s2)
            oa.copy_(ra)
            ob.copy_(rb)
            continue
        if inplace:
            a = a.clone()  # out_b needs the old a after out_a overwrote it
        torch.mul(a, c1, out=oa)
        oa.addcmul_(b, s1, value=-1)
        torch.mul(b, c2, out=ob)
        ob.addcmul_(a, s2)


def _viewable(grad, trig):
    """A gradient the complex kernel can view: one that arrives expanded (``out.sum().backward()``: stride 0) or
    strided is read once into a dense copy (the complex view needs adjacent pairs)."""
    if trig.freqs is not None and not complex_viewable(grad):
        return grad.contiguous()
    return grad


class _Rope(torch.autograd.Function):
    """Out-of-place rotation; backward = inverse rotation (saves only cos/sin)."""

    @staticmethod
    def forward(ctx, x, cos, sin, trig, seq_dim):
        out = torch.empty_like(x)
        _run(x, out, trig, seq_dim)
        ctx.trig, ctx.seq_dim = trig, seq_dim
        return out

    @staticmethod
    def backward(ctx, grad):
        inverse = ctx.trig.inverse()
        if torch.is_grad_enabled():  # create_graph=True: the backward must be differentiable (double backward)
            return _Rope.apply(grad, None, None, inverse, ctx.seq_dim), None, None, None, None
        grad = _viewable(grad, inverse)
        grad_in = torch.empty_like(grad)
        _run(grad, grad_in, inverse, ctx.seq_dim)
        return grad_in, None, None, None, None


class _RopeInplace(_Rope):
    """In-place rotation of x (marked dirty); the backward (inverse rotation) is _Rope's."""

    @staticmethod
    def forward(ctx, x, cos, sin, trig, seq_dim):
        _run(x, x, trig, seq_dim)
        ctx.mark_dirty(x)
        ctx.trig, ctx.seq_dim = trig, seq_dim
        return x


class _RopePair(torch.autograd.Function):
    """q and k rotated out of place by one Trig in one autograd node (the patched layers' call); backward = the
    inverse rotation of each gradient."""

    @staticmethod
    def forward(ctx, q, k, trig, seq_dim):
        oq, ok = torch.empty_like(q), torch.empty_like(k)
        _run(q, oq, trig, seq_dim)
        _run(k, ok, trig, seq_dim)
        ctx.trig, ctx.seq_dim = trig, seq_dim
        return oq, ok

    @staticmethod
    def backward(ctx, gq, gk):
        inverse = ctx.trig.inverse()
        out = []
        for g in (gq, gk):
            if g is None:
                out.append(None)
            elif torch.is_grad_enabled():  # create_graph=True: the backward must be differentiable
                out.append(_Rope.apply(g, None, None, inverse, ctx.seq_dim))
            else:
                g = _viewable(g, inverse)
                grad_in = torch.empty_like(g)
                _run(g, grad_in, inverse, ctx.seq_dim)
                out.append(grad_in)
        return out[0], out[1], None, None



def compact_trig(cos, sin, rotation, gptj_cos, unsqueeze_dim):
    """cos and the signed sin of :func:`compact`, shaped to broadcast over x (its rotated part, in (pairs, 2)
    views for GPT-J): made once for every tensor they rotate. cos/sin: folded (batch, seq, rd), in x's dtype."""
    rd = cos.shape[-1]
    half = rd // 2
    if rotation == "gptj":  # in (pairs, 2) views: swap = flip of the last dim
        if gptj_cos == "half":  # pair i meets cos[i]: broadcast over the pair, no repeat_interleave copy
            cos, s = cos[..., :half, None], sin[..., :half, None]
            signed = torch.cat((-s, s), dim=-1)
        else:
            cos, pairs = cos.unflatten(-1, (half, 2)), sin.unflatten(-1, (half, 2))
            signed = torch.stack((-pairs[..., 0], pairs[..., 1]), dim=-1)
        unsqueeze = unsqueeze_dim if unsqueeze_dim >= 0 else unsqueeze_dim - 1
    else:
        signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        unsqueeze = unsqueeze_dim
    return cos.unsqueeze(unsqueeze), signed.unsqueeze(unsqueeze), rd


def compact_one(x, trig, rotation):
    """``x * cos + swap(x) * signed_sin`` with the parts of :func:`compact_trig`."""
    cos, signed, rd = trig
    half = rd // 2
    if rotation == "deinterleave":
        x = torch.cat((x[..., 0:rd:2], x[..., 1:rd:2]), dim=-1)  # whole head (checked by the caller)
    r = x[..., :rd]
    if rotation == "gptj":
        r = r.unflatten(-1, (half, 2))
        out = (r * cos + r.flip(-1) * signed).flatten(-2)
    else:
        out = r * cos + torch.cat((r[..., half:], r[..., :half]), dim=-1) * signed
    return torch.cat((out, x[..., rd:]), dim=-1) if rd < x.shape[-1] else out


def compact(q, k, cos, sin, rotation, gptj_cos, unsqueeze_dim):
    """Both tensors as ``x * cos + swap(x) * signed_sin``: 10-14 dispatched ops per call, no host sync.

    For launch-bound devices without Triton, and under ``torch.compile`` (the compiler fuses it) or
    when cos/sin need gradients (plain autograd). ``swap`` exchanges the two rotated parts and the
    sign of the first part's sine is folded into ``signed_sin`` once for q and k: the same products as
    upstream's ``rotate_half``, so the result equals upstream's in every dtype. cos/sin: folded
    (batch, seq, rd), cast to q's dtype by the caller."""
    trig = compact_trig(cos, sin, rotation, gptj_cos, unsqueeze_dim)
    return compact_one(q, trig, rotation), compact_one(k, trig, rotation)


def rotate(x, cos, sin, trig, seq_dim, inplace=False):
    """Rotate one tensor (cos/sin do not need gradients: the caller runs ``compact`` where they do)."""
    fn = _RopeInplace if inplace else _Rope
    return fn.apply(x, cos, sin, trig, seq_dim)


def deinterleave(x, inplace=False):
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): DeepSeek's interleaved rotary input as NeoX halves.

    In place, x is overwritten through a fresh copy (autograd-safe: the copy's backward needs no old x)."""
    perm = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    return x.copy_(perm) if inplace else perm


def fold_contiguous(cos, section):
    """Qwen2-VL / GLM-4V mRoPE: (3, b, s, rd) -> (b, s, rd), T/H/W blocks of ``section`` (twice)."""
    split = list(section) * 2
    return torch.cat([m[i % 3] for i, m in enumerate(cos.split(split, dim=-1))], dim=-1)


_SHARED: dict = {}


def share_elements(q, k):
    """Whether q and k have an element in common. Disjoint slices of one fused QKV projection share a storage
    and interleave in memory without sharing an element: only those are checked element by element, on the
    layout alone (shapes, strides, offsets: a CPU bitmap over the span the two views cover, never q's device, so
    no host sync), once per layout."""
    if q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr() or not torch._C._overlaps(q, k):
        return False
    if q.dtype != k.dtype:
        return True
    key = (tuple(q.shape), q.stride(), q.storage_offset(), tuple(k.shape), k.stride(), k.storage_offset())
    found = _SHARED.get(key)
    if found is None:
        def end(t):
            return t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1

        lo = min(q.storage_offset(), k.storage_offset())
        marks = torch.zeros(max(end(q), end(k)) - lo, dtype=torch.bool)
        marks.as_strided(q.shape, q.stride(), q.storage_offset() - lo).fill_(True)
        found = bool(marks.as_strided(k.shape, k.stride(), k.storage_offset() - lo).any())
        if len(_SHARED) > 4096:
            _SHARED.clear()
        _SHARED[key] = found
    return found


def overlaps_itself(t):
    """Whether some elements of ``t`` share memory (a stride of 0 over a dimension of more than one element, or
    strides that interleave: torch's own in-place ops refuse such a tensor)."""
    verdict = torch._debug_has_internal_overlap(t)  # 0: no, 1: yes, 2: torch cannot tell cheaply
    if verdict != 2:
        return verdict == 1
    dims = sorted((abs(s), n) for s, n in zip(t.stride(), t.shape) if n > 1)
    span = 1
    for stride, size in dims:  # each dimension must step past the whole extent of the finer ones
        if stride < span:
            return True
        span = stride * (size - 1) + span
    return False
