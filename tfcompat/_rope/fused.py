"""Fused Triton RoPE: one launch rotates q and k, forward or backward, for every convention tfcompat covers.

Each program rotates a block of tokens and every q and k head of them (as Liger-Kernel's RoPE does per token):
one launch reads q and k once, writes them once (out of place) or back (in place), and reads each token's cos/sin
row once, its offsets computed per token. No host sync; nothing of q's size saved for backward (the inverse
rotation: the same kernel with ``INVERSE``). On CPU tensors Triton's interpreter runs it (``TRITON_INTERPRET=1``,
set before triton is imported), for testing only.

Index maps, per pair ``i`` of the rotary width ``RD`` (``HALF = RD // 2`` pairs):

- where the two parts are read from x and written to out: halves ``(i, i + HALF)`` or adjacent
  pairs ``(2i, 2i + 1)``. DeepSeek's interleaved layout (MLA) reads pairs and writes halves; its
  backward reads halves and writes pairs;
- which cos/sin channels meet them: ``(i, i + HALF)`` (NeoX), ``(2i, 2i + 1)`` (GPT-J, cos repeated
  per pair) or ``(i, i)`` (GPT-J, the attention takes cos's first half and repeat-interleaves it);
- with unfolded 3-row mRoPE cos (``ROWS3``), channel ``j`` comes from row T, H or W by the section
  that ``j mod HALF`` falls in (the fold the attention would do, without materialising it).

Math in fp32 (fp64 stays fp64); cos/sin are first cast to x's dtype, as the other implementations do.
"""

import os

import torch
import triton
import triton.language as tl

# Sized for the GPU: a program holds _PAIRS pairs of a head at a time (its tokens x the row's rotary pairs, a power
# of two: the cos/sin tile kept for every head) with _WARPS warps, and loops over the heads. tools/compile_proof.py
# proves every variant the launcher can produce for sm_80/90/100: no spill, at most _MAX_REGISTERS registers a
# thread, so at least 4 programs (16 warps) reside on an SM to keep loads in flight.
_PAIRS = 512
# read once, as Triton reads it when it decorates the kernels below
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_WARPS = 4
_MAX_REGISTERS = 128
_NVIDIA = torch.version.hip is None  # maxnreg is an NVIDIA option
# The interpreter runs programs one after another in Python: there the same rows go in fewer, larger programs (the
# arithmetic of a row does not depend on how rows are grouped; the tests also run the GPU tile interpreted)
_INTERPRETER_PAIRS = 4096

#: kernel launches since import (one per apply_rope call, one per backward), the first-use proofs' counted apart
launches = 0
proof_launches = 0


@triton.jit
def _pair_index(i, HALF: tl.constexpr, MODE: tl.constexpr):
    """The two channels of pair i: halves (0), adjacent pairs (1), or the same channel twice (2: GPT-J cos
    whose first half the attention repeat-interleaves)."""
    if MODE == 0:
        return i, i + HALF
    elif MODE == 1:
        return 2 * i, 2 * i + 1
    else:
        return i, i


@triton.jit
def _trig(ptr, base, j, sec0, sec1, sr, sd, mask, HALF: tl.constexpr, ROWS3: tl.constexpr,
          X_DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    offset = base + j * sd
    if ROWS3:  # unfolded mRoPE: channel j comes from row T, H or W by the section j mod HALF falls in
        m = j % HALF
        offset += tl.where(m < sec0, 0, tl.where(m < sec0 + sec1, 1, 2)) * sr
    v = tl.load(ptr + offset, mask=mask, other=0.0).to(X_DTYPE)
    if UPCAST:
        v = v.to(tl.float32)
    return v


@triton.jit
def _rotate_heads(x_ptr, o_ptr, xrow, orow, xh, xd, oh, od, heads, c1, c2, s1, s2, i, mask, tmask,
                  D: tl.constexpr, RD: tl.constexpr, BLOCK_TAIL: tl.constexpr, IN_PAIRS: tl.constexpr,
                  OUT_PAIRS: tl.constexpr, INVERSE: tl.constexpr, COPY_TAIL: tl.constexpr, UPCAST: tl.constexpr):
    """Every head of one tensor at the program's tokens, with the cos/sin the program loaded once: the head loop
    steps the row pointers by the head stride (64-bit pointer arithmetic, no index division per head)."""
    HALF: tl.constexpr = RD // 2
    ia, ib = _pair_index(i, HALF, IN_PAIRS)
    oa, obb = _pair_index(i, HALF, OUT_PAIRS)
    xp = x_ptr + xrow
    op = o_ptr + orow
    for _h in range(0, heads):
        a = tl.load(xp + ia[None, :] * xd, mask=mask, other=0.0)
        bb = tl.load(xp + ib[None, :] * xd, mask=mask, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            bb = bb.to(tl.float32)
        if INVERSE:  # da = ga c1 + gb s2 ; db = gb c2 - ga s1
            ra = a * c1 + bb * s2
            rb = bb * c2 - a * s1
        else:  # out_a = a c1 - b s1 ; out_b = b c2 + a s2
            ra = a * c1 - bb * s1
            rb = bb * c2 + a * s2
        tl.store(op + oa[None, :] * od, ra.to(o_ptr.dtype.element_ty), mask=mask)
        tl.store(op + obb[None, :] * od, rb.to(o_ptr.dtype.element_ty), mask=mask)
        if COPY_TAIL:  # partial rotary, out of place: the channels past RD pass through, BLOCK_TAIL at a time
            for c0 in range(RD, D, BLOCK_TAIL):
                c = c0 + tl.arange(0, BLOCK_TAIL)
                cmask = tmask[:, None] & (c < D)[None, :]
                tail = tl.load(xp + c[None, :] * xd, mask=cmask, other=0.0)
                tl.store(op + c[None, :] * od, tail, mask=cmask)
        xp += xh
        op += oh


@triton.jit
def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, seq, hq, hk, n_tokens, sec0, sec1,
                 qb, qh, qs, qd, kb, kh, ks, kd, qob, qoh, qos, qod, kob, koh, kos, kod,
                 cb, cs, cr, cd, sb, ss, sr, sd,
                 D: tl.constexpr, RD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 BLOCK_TAIL: tl.constexpr, IN_PAIRS: tl.constexpr, OUT_PAIRS: tl.constexpr, COS_MODE: tl.constexpr,
                 ROWS3: tl.constexpr, INVERSE: tl.constexpr, COPY_TAIL: tl.constexpr, UPCAST: tl.constexpr):
    """A program rotates BLOCK_T tokens: every q head, then every k head (q and k in one launch). The cos/sin rows
    of its tokens are loaded once, before the head loops, and the token's offsets are computed once per token."""
    HALF: tl.constexpr = RD // 2
    # token indices in int32 (the launcher refuses 2**31 tokens); offsets in int64: q past 2**31 elements stays exact
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < n_tokens
    s = (t % seq).to(tl.int64)
    b = (t // seq).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    mask = tmask[:, None] & (i < HALF)[None, :]
    j1, j2 = _pair_index(i, HALF, COS_MODE)
    x_dtype = q_ptr.dtype.element_ty
    cbase = (b * cb + s * cs)[:, None]
    sbase = (b * sb + s * ss)[:, None]
    c1 = _trig(cos_ptr, cbase, j1[None, :], sec0, sec1, cr, cd, mask, HALF, ROWS3, x_dtype, UPCAST)
    c2 = _trig(cos_ptr, cbase, j2[None, :], sec0, sec1, cr, cd, mask, HALF, ROWS3, x_dtype, UPCAST)
    s1 = _trig(sin_ptr, sbase, j1[None, :], sec0, sec1, sr, sd, mask, HALF, ROWS3, x_dtype, UPCAST)
    s2 = _trig(sin_ptr, sbase, j2[None, :], sec0, sec1, sr, sd, mask, HALF, ROWS3, x_dtype, UPCAST)
    _rotate_heads(q_ptr, qo_ptr, (b * qb + s * qs)[:, None], (b * qob + s * qos)[:, None], qh, qd, qoh, qod, hq,
                  c1, c2, s1, s2, i, mask, tmask, D, RD, BLOCK_TAIL, IN_PAIRS, OUT_PAIRS, INVERSE, COPY_TAIL, UPCAST)
    _rotate_heads(k_ptr, ko_ptr, (b * kb + s * ks)[:, None], (b * kob + s * kos)[:, None], kh, kd, koh, kod, hk,
                  c1, c2, s1, s2, i, mask, tmask, D, RD, BLOCK_TAIL, IN_PAIRS, OUT_PAIRS, INVERSE, COPY_TAIL, UPCAST)


_COS_MODES = {"neox": 0, "pairs": 1, "half": 2}


class Layout:
    """What one call needs to know beside the tensors; the same object serves its forward and backward."""

    __slots__ = ("in_pairs", "out_pairs", "cos_mode", "section")

    def __init__(self, rotation, gptj_cos, section):
        # rotation after the plan: "neox", "gptj" or "deinterleave" (pairs in, halves out, NeoX cos)
        self.in_pairs = rotation in ("gptj", "deinterleave")
        self.out_pairs = rotation == "gptj"
        self.cos_mode = _COS_MODES["neox" if rotation != "gptj" else (gptj_cos or "pairs")]
        self.section = tuple(section) if section is not None else None


def _bhsd(x, seq_dim):
    """A (batch, heads, seq, dim) view of x, whichever of the two layouts it has (no copy)."""
    return x if seq_dim == 2 else x.transpose(1, 2)


def unfit(q, k, cos, seq_dim, section=None):
    """Why one launch cannot serve q and k ('' when it can): the kernel walks both with q's batch, sequence and
    head_dim, and folds exactly three mRoPE sections (T, H, W), the same list in each half. Upstream folds
    ``section * 2`` cycling T, H, W, which for a list of 1 or 2 entries differs between the halves: those lists
    go to the composite, which folds them as upstream does."""
    q4, k4 = _bhsd(q, seq_dim), _bhsd(k, seq_dim)
    if q4.shape[0] != k4.shape[0] or q4.shape[2:] != k4.shape[2:] or q.dtype != k.dtype:
        return (f"q {tuple(q4.shape)} {q.dtype} and k {tuple(k4.shape)} {k.dtype} differ in batch, sequence, "
                f"head_dim or dtype (upstream broadcasts them)")
    if cos.shape[-3] not in (1, q4.shape[0]):
        return f"cos of batch {cos.shape[-3]} for q of batch {q4.shape[0]}"
    if section is not None and len(section) != 3:
        return (f"the mRoPE section list {list(section)} has {len(section)} entries (the kernel folds exactly 3: "
                f"T, H, W)")
    return ""


def fits(q, k, cos, seq_dim, section=None):
    """Whether one launch can serve q and k (:func:`unfit` says why not)."""
    return not unfit(q, k, cos, seq_dim, section)


def _check_launch(q4, k4, qo4, ko4, cos, sin, rows3, section):
    """Refuse anything the kernel would read or write out of bounds (it trusts the sizes it is given)."""
    from ..errors import RopeShapeError

    batch, _, seq, dim = q4.shape
    problems = []
    if k4.shape[0] != batch or k4.shape[2:] != q4.shape[2:]:
        problems.append(f"k {tuple(k4.shape)} differs from q {tuple(q4.shape)} in batch, seq or head_dim")
    if qo4.shape != q4.shape or ko4.shape != k4.shape:
        problems.append("an output buffer differs from its input's shape")
    if len({t.dtype for t in (q4, k4, qo4, ko4)}) != 1 or cos.dtype != sin.dtype:
        problems.append("q, k and the outputs (or cos and sin) differ in dtype")
    if len({t.device for t in (q4, k4, qo4, ko4, cos, sin)}) != 1:
        problems.append("the tensors are on different devices")
    if cos.shape != sin.shape or cos.dim() != (4 if rows3 else 3) or cos.shape[-3] not in (1, batch) or \
            cos.shape[-2] != seq or cos.shape[-1] > dim or cos.shape[-1] % 2 or cos.shape[-1] == 0:
        problems.append(f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} do not fit q {tuple(q4.shape)}")
    if rows3 and (cos.shape[0] != 3 or section is None or len(section) != 3 or
                  2 * sum(section) != cos.shape[-1]):
        problems.append(f"3-row cos {tuple(cos.shape)} with sections {section}")
    tokens = batch * seq
    if tokens + _INTERPRETER_PAIRS >= 2 ** 31:  # the kernel indexes tokens in int32 (offsets in int64)
        problems.append(f"{tokens} tokens (batch x seq) reach 2**31")
    if problems:
        raise RopeShapeError("tfcompat triton RoPE: " + "; ".join(problems) + "; nothing was launched (use "
                             "impl='composite', or pass tensors of the layout apply_rope documents)")


def _plan(q, k, qo, ko, cos, sin, layout, seq_dim, inverse):
    """What one launch over q's rows and k's (k=None: q's only) hands the kernel: ``(grid, args, meta)``, checked.

    Pure: nothing runs. The launch below and the compile proof (tools/compile_proof.py) both read it, so the
    variants proven for the GPU are the ones this function produces."""
    only_q = k is None
    if only_q:
        k, ko = q, qo
    q4, k4, qo4, ko4 = (_bhsd(t, seq_dim) for t in (q, k, qo, ko))
    batch, hq, seq, dim = q4.shape
    hk = 0 if only_q else k4.shape[1]
    rows3 = cos.dim() == 4
    _check_launch(q4, k4, qo4, ko4, cos, sin, rows3, layout.section)
    rd = cos.shape[-1]
    if inverse:  # the backward reads what the forward wrote, and writes where the forward read
        in_pairs, out_pairs = layout.out_pairs, layout.in_pairs
    else:
        in_pairs, out_pairs = layout.in_pairs, layout.out_pairs

    def trig_strides(t):
        # (batch, seq, row, dim) strides; a batch of 1 broadcasts over q's batch
        tb = t[0] if rows3 else t
        return ((0 if tb.shape[0] == 1 else tb.stride(0)), tb.stride(1), t.stride(0) if rows3 else 0, tb.stride(2))

    sec0, sec1 = (tuple(layout.section) + (0, 0))[:2] if rows3 else (0, 0)  # 1-3 sections: T, H, rest W
    block_half = triton.next_power_of_2(max(rd // 2, 1))
    pairs = _INTERPRETER_PAIRS if _INTERPRETED else _PAIRS
    block_t = max(1, pairs // block_half)  # tokens a program rotates, every head of each
    n_tokens = batch * seq
    grid = (triton.cdiv(n_tokens, block_t),)
    args = (q4, k4, qo4, ko4, cos, sin, seq, hq, hk, n_tokens, sec0, sec1,
            *q4.stride(), *k4.stride(), *qo4.stride(), *ko4.stride(), *trig_strides(cos), *trig_strides(sin))
    meta = dict(D=dim, RD=rd, BLOCK_T=block_t, BLOCK_HALF=block_half,
                BLOCK_TAIL=min(block_half, triton.next_power_of_2(max(dim - rd, 1))),
                IN_PAIRS=int(in_pairs), OUT_PAIRS=int(out_pairs), COS_MODE=layout.cos_mode, ROWS3=rows3,
                INVERSE=inverse, COPY_TAIL=(dim > rd and qo is not q),
                UPCAST=q.dtype in (torch.float16, torch.bfloat16), num_warps=_WARPS)
    if _NVIDIA:
        # the register budget said to ptxas: without it ptxas held some variants at 32 registers and spilled
        meta["maxnreg"] = _MAX_REGISTERS
    return grid, args, meta


def launch_context(device):
    """``device`` made current, so Triton launches on it and its current stream (a layer on ``cuda:1`` under
    ``device_map="auto"`` while ``cuda:0`` is current would launch on cuda:0's stream with cuda:1's pointers)."""
    import contextlib

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _launch(q, k, qo, ko, cos, sin, layout, seq_dim, inverse, plans=None):
    """One launch over q's rows and k's (k=None: q's only), on q's device and its current stream. ``plans``: the
    caller's dict for calls of the same q, k layout, cos, sin and layout (a step's rotation, every layer): the first
    call's plan, reused with the tensors swapped in (keyed by device too: device_map="auto")."""
    global launches
    key = (q.device, qo.stride(), ko.stride(), inverse) if plans is not None else None
    kept = plans.get(key) if plans is not None else None
    if kept is None:
        grid, args, meta = _plan(q, k, qo, ko, cos, sin, layout, seq_dim, inverse)
        if plans is not None:
            plans[key] = (grid, args[6:], meta)
    else:
        grid, rest, meta = kept
        if seq_dim == 2:
            args = (q, k, qo, ko, cos, sin, *rest)
        else:
            args = (q.transpose(1, 2), k.transpose(1, 2), qo.transpose(1, 2), ko.transpose(1, 2), cos, sin, *rest)
    with launch_context(q.device):
        _rope_kernel[grid](*args, **meta)
    launches += 1


class _TritonRope(torch.autograd.Function):
    """q and k rotated in one launch; backward = the inverse rotation in one launch (saves cos/sin only)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, layout, seq_dim, inplace, inverse=False, plans=None):
        if inplace:
            qo, ko = q, k
        else:
            qo, ko = torch.empty_like(q), torch.empty_like(k)
        _launch(q, k, qo, ko, cos, sin, layout, seq_dim, inverse, plans)
        if inplace:
            ctx.mark_dirty(q, k)
        ctx.save_for_backward(cos, sin)
        ctx.layout, ctx.seq_dim, ctx.inverse = layout, seq_dim, inverse
        return qo, ko

    @staticmethod
    def backward(ctx, gq, gk):
        # grads arrive materialised (an unused output's grad is zeros), possibly strided or expanded
        cos, sin = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the backward is itself a (differentiable) rotation
            dq, dk = _TritonRope.apply(gq, gk, cos, sin, ctx.layout, ctx.seq_dim, False, not ctx.inverse)
            return dq, dk, None, None, None, None, None, None, None
        # the gradient's own layout where it is dense (a (b, s, h, d) projection's transposed view stays so: no
        # copy when the projection's backward reads it); an expanded gradient gets a dense one
        dq, dk = torch.empty_like(gq), torch.empty_like(gk)
        _launch(gq, gk, dq, dk, cos, sin, ctx.layout, ctx.seq_dim, inverse=not ctx.inverse)
        return dq, dk, None, None, None, None, None, None, None


class _TritonRopeOne(torch.autograd.Function):
    """One tensor rotated in place: autograd allows a Function that writes into a view (``proj(x).view(...)``)
    only with a single output, so views that need gradients take one launch each."""

    @staticmethod
    def forward(ctx, x, cos, sin, layout, seq_dim):
        _launch(x, None, x, None, cos, sin, layout, seq_dim, inverse=False)
        ctx.mark_dirty(x)
        ctx.save_for_backward(cos, sin)
        ctx.layout, ctx.seq_dim = layout, seq_dim
        return x

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a differentiable inverse rotation
            dx, _ = _TritonRope.apply(grad, grad, cos, sin, ctx.layout, ctx.seq_dim, False, True)
            return dx, None, None, None, None
        dx = torch.empty_like(grad)
        _launch(grad, None, dx, None, cos, sin, ctx.layout, ctx.seq_dim, inverse=True)
        return dx, None, None, None, None


def interpreted():
    """Whether Triton runs kernels in its interpreter (CPU tensors) in this process."""
    return _INTERPRETED


def rope(q, k, cos, sin, layout, seq_dim, inplace=False, plans=None):
    """Rotate q and k. cos/sin: (batch or 1, seq, rd) or unfolded (3, batch or 1, seq, rd), not unsqueezed.
    ``plans``: see :func:`_launch` (the caller's promise: every call with it has q and k of one shape and stride,
    and the same cos, sin and layout)."""
    if inplace and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad) and \
            (q._base is not None or k._base is not None):
        return (_TritonRopeOne.apply(q, cos, sin, layout, seq_dim), _TritonRopeOne.apply(k, cos, sin, layout, seq_dim))
    return _TritonRope.apply(q, k, cos, sin, layout, seq_dim, inplace, False, plans)
