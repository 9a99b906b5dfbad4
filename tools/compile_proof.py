"""Compile proof for the GPU, with no GPU: every Triton kernel variant tfcompat can launch, compiled by Triton's own
compiler for real targets on this CPU, with ptxas's register and spill counts.

    python tools/compile_proof.py                     # every variant for sm_80, sm_90, sm_100: a table
    python tools/compile_proof.py --arch 90 --json proof.json --jobs 2
    python tools/compile_proof.py --arch 90 --part 0/2     # every other variant (the tests run the parts apart)

The variants are what the launcher computes (``fused._plan``, the function every launch goes through), over
every layout ``apply_rope(impl="triton")`` hands it: NeoX, GPT-J with either cos layout and DeepSeek's interleaved
(MLA) layout; folded or 3-row mRoPE cos; forward and inverse (the backward); out of place (a partial-rotary tail
copied) and in place; fp32, bf16 and fp16 (cos in the same dtype, and fp32 cos beside bf16/fp16 q); the head and
rotary widths of the families' published configs (64, 80, 96, 128, 192, 256; partial factors 1, 1/2, 1/4); a
training shape (packed row, grouped kv heads) and a decoding shape (one token, one kv head), whose integers Triton
specialises differently (a 1 becomes a constant). Each is bound by Triton's own binder for the target, so the
signature, constants and alignment attributes are those a launch on that GPU compiles, deduplicated by them.

A variant fails on a compile error, any spill byte, or more registers a thread than the launch is designed for
(``fused._MAX_REGISTERS``). Exit status 0 only if every variant passes. The table's columns: variant,
target, registers, spill stores/loads (bytes), the loads outside / inside the head loops in Triton's IR (a program
loads its tokens' cos/sin once, 4 loads (2 for GPT-J's half cos), then loops over every q and k head: cos/sin are
read per token, not per (token, head)), compile seconds.

Runs without ``TRITON_INTERPRET`` (the interpreter replaces the kernels: this script unsets it for itself). Each
run uses a fresh Triton cache, so ptxas runs for every variant.
"""

import argparse
import concurrent.futures
import contextlib
import io
import json
import os
import re
import sys
import tempfile
import time

ARCHS = (80, 90, 100)
HEADS = (64, 80, 96, 128, 192, 256)
# (name, rotation, gptj cos layout, mRoPE rows, partial rotary factors, head widths): the plans families resolve to
# (tfcompat report: rope.apply) with the rotary factors their configs use
PLANS = (
    ("neox", "neox", "", False, (1, 2, 4), HEADS),              # Qwen2/3, Qwen3-Next/3.5 (1/4), GLM-4.5 (1/2)
    ("neox-mrope3", "neox", "", True, (1, 2), (80, 128)),       # Qwen2-VL / 2.5-VL / GLM-4.5V on 4.x: 3-row cos
    ("gptj-half", "gptj", "half", False, (2,), (64, 128)),      # GLM-4, ChatGLM (cos's first half, repeated)
    ("gptj-pairs", "gptj", "pairs", False, (2,), (64, 128)),    # GLM-4V, GLM-OCR (cos repeated per pair)
    ("gptj-pairs-mrope3", "gptj", "pairs", True, (2,), (128,)),  # GLM-4V on 4.x: 3-row cos
    ("deinterleave", "deinterleave", "", False, (1,), (64,)),   # GLM-4.7-Flash / GLM-5 (MLA): qk_rope_head_dim 64
)
# (name, batch, seq, q heads, kv heads): a packed training row with grouped kv heads; a decoding step
SHAPES = (("train", 1, 48, 8, 2), ("decode", 4, 1, 8, 1))


def _dtypes():
    import torch

    # (q dtype, cos dtype): the model's cos in q's dtype, and fp32 cos beside half q (the kernel casts it)
    return ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
            (torch.bfloat16, torch.float32), (torch.float16, torch.float32))


def _cases(full):
    """(plan, head, rotary, shape, q dtype, cos dtype) to plan launches for. ``full``: the cross product of every
    axis (about 750 launches a target). Otherwise a covering set around one base (bf16 q and cos, the training
    shape): every plan at each of its widths, then each other dtype pair and the decoding shape at the plan's
    first width; each with every mode the launcher has (forward, backward, in place)."""
    import torch

    dtypes = _dtypes()
    for name, rotation, gptj_cos, rows3, factors, heads in PLANS:
        widths = [(d, d // f) for d in heads for f in factors]
        if not full:  # partial factors at the widths their families use (128, 256), full rotary at every head
            widths = [(d, r) for d, r in widths if r == d or d in (128, 256)]
        widths = [(d, r) for d, r in widths if r % 2 == 0 and not (rows3 and r % 4)]
        if full:
            for dim, rd in widths:
                for shape in SHAPES:
                    for dt, cdt in dtypes:
                        yield name, rotation, gptj_cos, rows3, dim, rd, shape, dt, cdt
            continue
        base = (torch.bfloat16, torch.bfloat16)
        for dim, rd in widths:
            yield name, rotation, gptj_cos, rows3, dim, rd, SHAPES[0], *base
        dim, rd = next((d, r) for d, r in widths if d == 128) if any(d == 128 for d, _ in widths) else widths[0]
        for dt, cdt in dtypes:
            if (dt, cdt) != base:
                yield name, rotation, gptj_cos, rows3, dim, rd, SHAPES[0], dt, cdt
        for shape in SHAPES[1:]:
            yield name, rotation, gptj_cos, rows3, dim, rd, shape, *base


def variants(full=False):
    """Every (label, grid, args, meta) the launcher produces over the enumeration (CPU tensors, nothing runs)."""
    import torch

    from tfcompat._rope import fused as rt

    out = []
    for name, rotation, gptj_cos, rows3, dim, rd, (shape, batch, seq, hq, hk), dt, cdt in _cases(full):
        half = rd // 2
        section = (half - 2 * (half // 3), half // 3, half // 3) if rows3 else None
        layout = rt.Layout(rotation, gptj_cos, section)
        q = torch.empty(batch, seq, hq, dim, dtype=dt)
        k = torch.empty(batch, seq, hk, dim, dtype=dt)
        cshape = (3, 1, seq, rd) if rows3 else (1, seq, rd)
        cos, sin = torch.empty(cshape, dtype=cdt), torch.empty(cshape, dtype=cdt)
        modes = [("fwd", False, False), ("bwd", True, False)]
        if rd < dim:  # in place: the tail stays where it is (no copy)
            modes.append(("fwd-inplace", False, True))
        for mode, inverse, inplace in modes:
            qo, ko = (q, k) if inplace else (torch.empty_like(q), torch.empty_like(k))
            grid, args, meta = rt._plan(q, k, qo, ko, cos, sin, layout, 1, inverse)
            label = f"{name} d{dim} rd{rd} {str(dt)[6:]}/{str(cdt)[6:]} {mode} {shape}"
            out.append((label, grid, args, meta))
    return out


def _bind(kernel, args, meta, arch):
    """Triton's own binding for a launch on ``arch``: (source, options, key), no device needed."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", arch, 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **meta)
    options, signature, constexprs, attrs = kernel._pack_args(backend, meta, bound, specialization, options)
    key = repr((arch, sorted(signature.items()), sorted(constexprs.items()), sorted(attrs.items())))
    return ASTSource(kernel, signature, constexprs, attrs), options, key


_PTXAS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads|Used (\d+) registers")


_VARIANTS = {}


def _compile(job):
    """Compile variant ``index`` of the enumeration for one target (bound again here: a worker process builds the
    enumeration itself); ptxas's log gives registers and spills."""
    index, arch, full = job
    import triton
    from triton.backends.compiler import GPUTarget

    from tfcompat._rope import fused as rt

    if full not in _VARIANTS:
        _VARIANTS[full] = variants(full)
    label, _grid, args, meta = _VARIANTS[full][index]
    src, options, _key = _bind(rt._rope_kernel, args, meta, arch)
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    t0 = time.perf_counter()
    log = io.StringIO()
    row = {"variant": label, "target": f"sm_{arch}", "registers": None, "spill_stores": None, "spill_loads": None,
           "error": None}
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options.__dict__)
        row["loads_per_token"], row["loads_per_head"] = load_placement(compiled.asm["ttir"])
    except Exception as exc:  # a compile error is the proof failing: report it, do not stop the others
        row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    for m in _PTXAS.finditer(log.getvalue()):
        if m.group(3):
            row["registers"] = int(m.group(3))
        else:
            row["spill_stores"], row["spill_loads"] = int(m.group(1)), int(m.group(2))
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def load_placement(ttir):
    """(loads outside every loop, loads inside the head loops) of the kernel's Triton IR, read from the compiler's
    own output: a program loads its tokens' cos/sin rows once (4 loads: two channels of cos and of sin), before the
    ``scf.for`` loops over the q and k heads, which load x (2 a head, plus a partial-rotary tail's chunks)."""
    depth, outside, inside = 0, 0, 0
    for line in ttir.splitlines():
        text = line.strip()
        if "tt.load" in text:
            if depth:
                inside += 1
            else:
                outside += 1
        if text.startswith("scf.for") or " = scf.for " in text:
            depth += 1
        elif text == "}" and depth:
            depth -= 1
    return outside, inside


#: the cos/sin loads a program makes per token (``load_placement``), never per (token, head): two channels of cos and
#: of sin, or one of each where the two channels are one (GPT-J's half cos: the compiler merges the equal loads)
TRIG_LOADS = (2, 4)


def verdict(row, max_registers):
    """Why a compiled variant fails the proof ('' when it passes)."""
    if row["error"]:
        return row["error"]
    if row.get("loads_per_token") not in TRIG_LOADS or not row.get("loads_per_head"):
        return (f"{row.get('loads_per_token')} loads outside the head loops (cos/sin: 2 or 4 a token, loaded "
                f"once for every head), {row.get('loads_per_head')} inside")
    if row["registers"] is None or row["spill_stores"] is None:
        return "ptxas reported no register or spill counts"
    if row["spill_stores"] or row["spill_loads"]:
        return f"spills {row['spill_stores']} B stored / {row['spill_loads']} B loaded a thread"
    if row["registers"] > max_registers:
        return f"{row['registers']} registers > {max_registers} the launch is sized for"
    return ""


def prove(archs=ARCHS, jobs=1, only=None, full=False, part=(0, 1)):
    """Compile every variant for every target; returns (rows, max registers). ``only``: label substring filter;
    ``part`` (k, n): the variants whose place in the enumeration is k modulo n."""
    os.environ.pop("TRITON_INTERPRET", None)
    from tfcompat._rope import fused as rt

    if not hasattr(rt._rope_kernel, "params"):
        raise SystemExit("compile_proof: Triton's interpreter replaced the kernels (TRITON_INTERPRET was set when "
                         "triton was imported); run this script in a fresh process without it")
    with tempfile.TemporaryDirectory() as cache:
        # a fresh cache: ptxas runs (and reports) for every variant, also in the pool's worker processes
        before = os.environ.get("TRITON_CACHE_DIR")
        os.environ["TRITON_CACHE_DIR"] = cache
        try:
            return _prove(rt, archs, jobs, only, full, part)
        finally:
            if before is None:
                os.environ.pop("TRITON_CACHE_DIR")
            else:
                os.environ["TRITON_CACHE_DIR"] = before


def _prove(rt, archs, jobs, only, full, part):
    todo, seen = [], set()
    _VARIANTS[full] = variants(full)
    for index, (label, _grid, args, meta) in enumerate(_VARIANTS[full]):
        if (only and only not in label) or index % part[1] != part[0]:
            continue
        for arch in archs:
            _src, _options, key = _bind(rt._rope_kernel, args, meta, arch)
            if key not in seen:  # equal signature, constants and attributes: one compiled kernel
                seen.add(key)
                todo.append((index, arch, full))
    if jobs > 1:
        with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
            rows = list(pool.map(_compile, todo))
    else:
        rows = [_compile(job) for job in todo]
    return rows, rt._MAX_REGISTERS


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, action="append", help="compute capability x10 (80, 90, 100); repeatable")
    parser.add_argument("--jobs", type=int, default=1, help="compiler processes")
    parser.add_argument("--only", help="variants whose label contains this")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--all", action="store_true", help="the cross product of every axis (~750 a target)")
    parser.add_argument("--part", default="0/1", help="K/N: every N-th variant from the K-th (default 0/1: all)")
    opts = parser.parse_args(argv)
    k, n = (int(x) for x in opts.part.split("/"))
    if not 0 <= k < n:
        parser.error(f"--part {opts.part}: K/N with 0 <= K < N")
    os.environ.pop("TRITON_INTERPRET", None)
    t0 = time.perf_counter()
    rows, max_regs = prove(tuple(opts.arch or ARCHS), opts.jobs, opts.only, opts.all, (k, n))
    took = time.perf_counter() - t0
    failed = 0
    print(f"{'variant':<52} {'target':<7} {'regs':>4} {'spill':>9} {'loads t/h':>9}  {'s':>5}  verdict")
    for row in rows:
        why = verdict(row, max_regs)
        failed += bool(why)
        spill = "-" if row["spill_stores"] is None else f"{row['spill_stores']}/{row['spill_loads']}"
        loads = f"{row.get('loads_per_token', '-')}/{row.get('loads_per_head', '-')}"
        print(f"{row['variant']:<52} {row['target']:<7} {row['registers'] or '-':>4} {spill:>9} {loads:>9}  "
              f"{row['seconds']:>5.1f}  {why or 'ok'}")
    regs = [r["registers"] for r in rows if r["registers"] is not None]
    print(f"{len(rows)} compiled variants ({', '.join(f'sm_{a}' for a in (opts.arch or ARCHS))}), {failed} failed; "
          f"registers {min(regs, default=0)}-{max(regs, default=0)} (limit {max_regs}), spill bytes "
          f"{sum((r['spill_stores'] or 0) + (r['spill_loads'] or 0) for r in rows)}; cos/sin loads per token "
          f"(outside the head loops) {sorted({r.get('loads_per_token') for r in rows}, key=str)}; {took:.0f} s")
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump({"max_registers": max_regs, "rows": rows}, fh, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
