"""GPU checks for a lent accelerator: flash-attn's varlen path against the exact fallback.

    python bench/gpu_check.py            # needs CUDA; flash-attn optional (reported when missing)

1. varlen_attention on CUDA bf16 with flash-attn, and PyTorch's varlen_attn (causal and windowed), vs the
   SDPA fallback (forward and gradients).
2. A patched tiny Qwen2-VL on a packed batch vs the unpatched model on the padded batch, on CUDA.
3. apply_rope native vs upstream on CUDA (fp32 and bf16).
Prints one line per check with the max abs difference and the tolerance; exits non-zero on failure.
"""

import sys

import torch


def main():
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    from tfcompat import varlen
    from tfcompat.varlen import _sdpa_fallback, flash_attn_available, varlen_attention

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
        """Forward and gradients of one packed-attention kernel against the exact fallback (bf16)."""
        ref = _sdpa_fallback(q, k, v, cu.tolist(), 64 ** -0.5, True, window, 0.0)
        go = torch.randn_like(out)
        ga = torch.autograd.grad(out, (q, k, v), go)
        gb = torch.autograd.grad(ref, (q, k, v), go)
        diff = max((out - ref).abs().max().item(), *[(a - b).abs().max().item() for a, b in zip(ga, gb)])
        print(f"[{'ok' if diff <= 2e-2 else 'FAIL'}] {label} vs fallback bf16: max|diff| {diff:.3g} (tol 2e-2)")
        return diff > 2e-2

    if flash_attn_available(q):
        failures += against_fallback("varlen flash", varlen_attention(q, k, v, cu), None)
    else:
        print("[skip] flash-attn is not importable: pip install flash-attn")
    if varlen._torch_varlen() is not None:
        # PyTorch's own varlen kernel, as varlen._varlen calls it (causal, and a sliding window of 64)
        for window in (None, 64):
            left = -1 if window is None else window - 1
            out = varlen._torch_varlen()(q, k, v, cu, cu, 511, 511, scale=64 ** -0.5, window_size=(left, 0),
                                         enable_gqa=True)
            failures += against_fallback(f"torch varlen_attn (window {window})", out, window)
    else:
        print("[skip] this torch has no torch.nn.attention.varlen")

    from tfcompat import _checks

    torch.set_default_device(dev)
    try:
        for check in ("rope.native.fp32", "rope.native.bf16", "attention.packed"):
            fn = {c: f for c, f, _ in _checks.CHECKS}[check]
            res = _checks._result("qwen2_vl", check, lambda fn=fn: fn("qwen2_vl"), None)
            failures += not res["passed"]
            print(f"[{'ok' if res['passed'] else 'FAIL'}] qwen2_vl {check} on CUDA: max|diff| "
                  f"{res['max_abs_diff']:.3g} (tol {res['tolerance']:.2g}) {res['error'] or ''}")
    finally:
        torch.set_default_device("cpu")
    del varlen
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
