"""GPU checks for a lent accelerator, one script of at most ~5 minutes on one GPU.

    python bench/gpu_check.py            # needs CUDA; flash-attn and liger-kernel optional (reported when missing)

1. varlen_attention on CUDA bf16 with flash-attn, and PyTorch's varlen_attn (causal and windowed), vs the
   SDPA fallback (forward and gradients).
2. A patched tiny Qwen2-VL on a packed batch vs the unpatched model on the padded batch, on CUDA.
3. apply_rope native vs upstream on CUDA (fp32 and bf16).
4. RoPE speed, bf16, Qwen2.5-VL-7B and GLM-4.1V-9B head shapes at 16k and 64k tokens, side by side in one
   run: the fused Triton kernel vs upstream vs the compact composite vs Liger-Kernel's RoPE (Qwen shape: Liger
   has no GPT-J kernel) vs a bandwidth copy (``q.clone(); k.clone()``, the physical limit), forward and
   forward+backward, with the Triton result checked against upstream's. Targets: Triton forward within 1.3x
   of the copy, forward+backward at most 0.5x upstream's, faster than Liger's.
5. Context-parallel pieces (fewer queries than keys: a rank's query chunk at the end of its sequence's keys)
   through flash-attn's and PyTorch's varlen kernels with ``cu_seqlens_q != cu_seqlens_k``: whether their
   causal mask aligns bottom-right, as tfcompat's SDPA pieces do (what a CUDA kernel for ``context_group``
   would rely on; tfcompat does not use one yet).
Prints one line per check with the max abs difference and the tolerance; exits non-zero on failure.
"""


import torch


def main():
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    from tfcompat import varlen
    from tfcompat._attention import kernels as _kv
    from tfcompat._attention.kernels import _sdpa_fallback
    from tfcompat.varlen import flash_attn_available, varlen_attention

    dev = torch.device("cuda")
    failures = 0
    g = torch.Generator(device=dev).manual_seed(0)
    cu = torch.tensor([0, 100, 101, 612, 1000], dtype=torch.int32, device=dev)
    q = torch.randn(1000, 8, 64, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True)
    k = torch.randn(1000, 2, 64, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True)
    v = torch.randn(1000, 2, 64, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True)
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name()}, flash-attn usable: "
          f"{flash_attn_available(q)}")
    def against_fallback(label, out, window):
        """Forward and gradients of one packed-attention kernel against the exact fallback in fp32."""
        go = torch.randn_like(out)
        got = (out, *torch.autograd.grad(out, (q, k, v), go))
        want = fp32_reference(lambda a, b, c: _sdpa_fallback(a, b, c, cu.tolist(), 64 ** -0.5, True, window, 0.0),
                              (q, k, v), go)
        ok, text = verdict(got, want, q.dtype)
        print(f"[{'ok' if ok else 'FAIL'}] {label} vs the fp32 fallback: {text}")
        return not ok

    if flash_attn_available(q):
        failures += against_fallback("varlen flash", varlen_attention(q, k, v, cu), None)
    else:
        print("[skip] flash-attn is not importable: pip install flash-attn")
    if _kv._choice.torch_ships("nn/attention/varlen.py"):
        # PyTorch's own varlen kernel, as _attention.kernels._varlen calls it (causal, and a sliding window of 64)
        from tfcompat._attention import gpu_calls as calls

        for window in (None, 64):
            args, kwargs = calls.torch_call(q, k, v, cu, 511, causal=True, scale=64 ** -0.5, window=window,
                                            params=_kv._choice.torch_varlen_params())
            out = _kv._choice.torch_varlen()(*args, **kwargs)
            failures += against_fallback(f"torch varlen_attn (window {window})", out, window)
    else:
        print("[skip] this torch has no torch.nn.attention.varlen")

    # the checks `tfcompat check --device cuda` runs (inputs drawn on the CPU, moved to the device), on one family
    from tfcompat._tools import device_checks as _device_checks

    for res in _device_checks.run(["qwen2_vl"], "cuda", "bf16"):
        failures += not res["passed"]
        print(result_line(res))
    failures += piece_alignment(dev)
    del varlen
    failures += rope_speed(dev)
    return 1 if failures else 0


def fp32_reference(fn, inputs, grad_out):
    """fn's output and input gradients computed in fp32 from the same (half-precision) values."""
    leaves = [t.detach().float().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    return (out, *torch.autograd.grad(out, leaves, grad_out.float()))


def verdict(got, want, dtype):
    """(ok, text): the kernel's outputs and gradients against the fp32 reference by the first-use proofs' rule
    (|got - want| <= tol * max(1, max |want|), tol 2**-6 for bf16): a kernel that accumulates in fp32 and rounds
    once passes with gradients of any size (|dv| reaches ~10 here); a wrong row or sign is off by the values' own
    size. (bf16 against the bf16 fallback at 2e-2 absolute failed a correct FA2-precision kernel by 0.094.)"""
    from tfcompat._kernels.table import _compare

    worst, ok, tol = _compare(tuple(got), tuple(want), dtype)
    scale = max(float(w.detach().float().abs().max()) for w in want)
    return ok, f"max|diff| {worst:.3g} (tol {tol:.2g} x max(1, {scale:.3g}))"


def result_line(res):
    """One line of a ``tfcompat check --device`` result, skipped ones included (they carry no numbers)."""
    mark = "skip" if res.get("skipped") else "ok" if res["passed"] else "FAIL"
    if res.get("skipped"):
        return f"[{mark}] {res['family']} {res['check']} on CUDA: {res['skipped']}"
    diff = "n/a" if res["max_abs_diff"] is None else f"{res['max_abs_diff']:.3g}"
    tol = "n/a" if res["tolerance"] is None else f"{res['tolerance']:.2g}"
    return f"[{mark}] {res['family']} {res['check']} on CUDA: max|diff| {diff} (tol {tol}) {res['error'] or ''}"


def pieces_reference(q, k, v, cu_q, cu_k, scale):
    """Each piece's queries are the last of its keys and see the keys up to themselves (bottom-right causal):
    tfcompat's context-parallel SDPA pieces (their mask), piece by piece."""
    from tfcompat._parallel.context import _piece_mask

    outs = []
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for q0, q1, k0, k1 in zip(bq[:-1], bq[1:], bk[:-1], bk[1:]):
        mask = _piece_mask(q1 - q0, k1 - k0, None, q.device)
        out = torch.nn.functional.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1)[None], k[k0:k1].transpose(0, 1)[None], v[k0:k1].transpose(0, 1)[None],
            attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


def piece_alignment(dev):
    """Check 5: varlen kernels on pieces with fewer queries than keys, against the bottom-right reference."""
    from tfcompat import varlen
    from tfcompat._attention import kernels as _kv
    from tfcompat._probe import backends as _backends

    g = torch.Generator(device=dev).manual_seed(1)
    cu_q = torch.tensor([0, 300, 450, 451], dtype=torch.int32, device=dev)   # query chunks of three sequences
    cu_k = torch.tensor([0, 700, 900, 1000], dtype=torch.int32, device=dev)  # each sequence's keys up to them
    q = torch.randn(451, 8, 64, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True)
    k = torch.randn(1000, 2, 64, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True)
    v = torch.randn(1000, 2, 64, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True)
    ref = pieces_reference(q, k, v, cu_q, cu_k, 64 ** -0.5)
    go = torch.randn_like(ref)
    ref32 = fp32_reference(lambda a, b, c: pieces_reference(a, b, c, cu_q, cu_k, 64 ** -0.5), (q, k, v), go)
    kernels = {}
    if varlen.flash_attn_available(q):
        kernels["flash-attn varlen (causal)"] = lambda: _backends.flash_varlen()(
            q, k, v, cu_q, cu_k, 300, 700, softmax_scale=64 ** -0.5, causal=True)
    if _backends.torch_ships("nn/attention/varlen.py"):
        import inspect

        # enable_gqa where the installed varlen_attn takes it (2.13); 2.11's shares kv heads itself
        gqa = {"enable_gqa": True} if "enable_gqa" in inspect.signature(_kv._choice.torch_varlen()).parameters else {}
        kernels["torch varlen_attn (window (-1, 0))"] = lambda: _kv._choice.torch_varlen()(
            q, k, v, cu_q, cu_k, 300, 700, scale=64 ** -0.5, window_size=(-1, 0), **gqa)
    failures = 0
    for label, run in kernels.items():
        try:
            out = run()
            got = torch.autograd.grad(out, (q, k, v), go)
        except Exception as exc:  # report and go on: the answer is what this check is for
            print(f"[FAIL] context piece through {label}: {type(exc).__name__}: {exc}")
            failures += 1
            continue
        ok, text = verdict((out, *got), ref32, q.dtype)
        print(f"[{'ok' if ok else 'FAIL'}] context piece through {label}: "
              f"{'bottom-right' if ok else 'NOT bottom-right (or wrong)'}, {text}")
        failures += not ok
    if not kernels:
        print("[skip] context pieces: neither flash-attn nor torch.nn.attention.varlen here")
    return failures


def cuda_ms(fn, repeats=20, setup=None):
    """Median milliseconds of fn on the GPU (CUDA events around each call; setup outside the timing)."""
    times = []
    for i in range(repeats + 3):
        args = setup() if setup else ()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:  # warm-up: Triton compiles, caches fill
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _liger(cos):
    """Liger-Kernel's RoPE in upstream's calling convention, or None (not installed)."""
    try:
        if cos.dim() == 4:
            from liger_kernel.transformers.qwen2vl_mrope import liger_multimodal_rotary_pos_emb as fn
            return fn
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
        return lambda q, k, c, s, section=None: liger_rotary_pos_emb(q, k, c, s)
    except ImportError:
        return None


def rope_row(name, tokens, dev):
    """One shape and length: timings, ratios, and the Triton result checked against upstream's."""
    from rope import SHAPES, inputs  # bench/rope.py, beside this script

    from tfcompat.config import rope_parameters
    from tfcompat.rope import apply_rope, apply_rope_

    config, cos, sin, q, k, gq, gk = inputs(name, tokens, torch.bfloat16, dev)
    section = rope_parameters(config).mrope_section
    liger = _liger(cos) if SHAPES[name][0] == "qwen2_5_vl" else None

    def rope(impl):
        return lambda a=q, b=k: apply_rope(a, b, cos, sin, config=config, impl=impl)

    got, want = rope("triton")(), rope("upstream")()
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
    # bf16: upstream rounds three times, the kernel once (the tolerance of tests/_helpers.TOL)
    ok = all(torch.isclose(a.float(), b.float(), rtol=2 ** -7, atol=2 ** -6).all().item() for a, b in zip(got, want))

    def fwd_bwd(fn):
        def setup():
            return q.detach().clone().requires_grad_(True), k.detach().clone().requires_grad_(True)

        return cuda_ms(lambda a, b: torch.autograd.backward(fn(a, b), (gq, gk)), setup=setup)

    r = {"copy": cuda_ms(lambda: (q.clone(), k.clone())), "triton": cuda_ms(rope("triton")),
         "inplace": cuda_ms(lambda a, b: apply_rope_(a, b, cos, sin, config=config, impl="triton"),
                            setup=lambda: (q.clone(), k.clone())),
         "upstream": cuda_ms(rope("upstream")), "composite": cuda_ms(rope("composite")),
         "fb_triton": fwd_bwd(rope("triton")), "fb_upstream": fwd_bwd(rope("upstream"))}
    if liger is not None:
        r["liger"] = cuda_ms(lambda: liger(q, k, cos, sin, section))
        r["fb_liger"] = fwd_bwd(lambda a, b: liger(a, b, cos, sin, section))
    na = float("nan")
    print(f"{name:<14}{tokens:>7}{r['copy']:9.3f}{r['triton']:8.3f}{r['inplace']:7.3f}{r['upstream']:8.3f}"
          f"{r['composite']:7.3f}{r.get('liger', na):7.3f}{r['triton'] / r['copy']:9.2f}"
          f"{r['fb_triton']:8.3f}{r['fb_upstream']:8.3f}{r.get('fb_liger', na):9.3f}"
          f"{r['fb_triton'] / r['fb_upstream']:10.2f}{r['triton'] / r.get('liger', na):10.2f}"
          f"  [{'ok' if ok else 'FAIL'} max|triton-upstream| {diff:.3g}]", flush=True)
    return 0 if ok else 1


def rope_speed(dev):
    from rope import SHAPES  # bench/rope.py, beside this script

    from tfcompat.rope import impl_for

    print(f"apply_rope impl='auto' on CUDA: {impl_for(dev)}")
    print(f"{'shape':<14}{'tokens':>7}{'copy ms':>9}{'triton':>8}{'inpl':>7}{'upstr':>8}{'comp':>7}{'liger':>7}"
          f"{'tri/copy':>9}{'fb tri':>8}{'fb up':>8}{'fb liger':>9}{'fb tri/up':>10}{'tri/liger':>10}")
    failures = 0
    for name in SHAPES:
        for tokens in (16384, 65536):
            failures += rope_row(name, tokens, dev)
            torch.cuda.empty_cache()
    print("targets: tri/copy <= 1.3, fb tri/up <= 0.5, tri/liger < 1 (liger: Qwen shape only; nan where absent)")
    return failures


if __name__ == "__main__":
    import sys

    sys.exit(main())
