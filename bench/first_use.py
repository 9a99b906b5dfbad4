"""What the first-use proof of a GPU kernel costs: once per (device, dtype, layout), and per call after it.

    TRITON_INTERPRET=1 python bench/first_use.py      # here: the Triton RoPE kernel in Triton's interpreter (CPU)
    python bench/first_use.py                         # on a GPU: the Triton kernel on CUDA

Prints, side by side in one run: the proof's own time (``table.proven()``), the first call (proof + the call), a
later call of the same layout, and the per-call cost of the proven look-up alone (``fused_proof.proven`` on a
proven key), on a Qwen2.5-7B-shaped row (a small one in the interpreter).
"""

import os
import time

import torch


def main():
    from tfcompat import clear_cache
    from tfcompat._kernels import table
    from tfcompat._rope import fused, fused_proof
    from tfcompat.rope import apply_rope

    cuda = torch.cuda.is_available() and not fused.interpreted()
    dev = "cuda" if cuda else "cpu"
    if not cuda and not fused.interpreted():
        print("needs a CUDA device, or TRITON_INTERPRET=1 (set before triton is imported)")
        return 2
    seq, hq, hk, dim = (16384, 28, 4, 128) if cuda else (64, 4, 2, 128)
    q = torch.randn(1, seq, hq, dim, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, seq, hk, dim, device=dev, dtype=torch.bfloat16)
    emb = torch.randn(1, seq, dim, device=dev)
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)

    def call():
        out = apply_rope(q, k, cos, sin, model_type="qwen2", unsqueeze_dim=2, impl="triton")
        if cuda:
            torch.cuda.synchronize()
        return out

    clear_cache()
    t0 = time.perf_counter()
    call()
    first = time.perf_counter() - t0
    proof = table.proven()[0]["seconds"]
    t0 = time.perf_counter()
    for _ in range(5):
        call()
    later = (time.perf_counter() - t0) / 5
    layout = fused.Layout("neox", "", None)
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        fused_proof.proven(q, k, cos, sin, layout, 1, False, "neox", "", True)
    lookup = (time.perf_counter() - t0) / n
    where = f"{dev}{' (Triton interpreter)' if fused.interpreted() else ''}, torch {torch.__version__}"
    print(f"first-use proof, {where}, q {tuple(q.shape)} bf16:")
    print(f"  proof alone {proof * 1e3:9.2f} ms   first call {first * 1e3:9.2f} ms   later call {later * 1e3:9.2f} ms")
    print(f"  proven look-up per call after it: {lookup * 1e6:.2f} us")
    return 0


if __name__ == "__main__":
    import sys

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    sys.exit(main())
