"""RoPE inside torch.compile: the fused Triton kernel (eager) against the composite compiled by inductor, on CUDA.

    python bench/rope_compiled.py          # needs CUDA (about 1 minute)

Under torch.compile the patched model rotates q and k with the composite (10-14 tensor ops), which inductor
fuses into its own generated Triton kernels, rather than calling tfcompat's Triton kernel as an opaque op. This
measures that choice side by side in one run, bf16, Qwen2.5-VL-7B and GLM-4.1V-9B head shapes (mRoPE) at 16k and
64k tokens: forward and forward+backward milliseconds of the copy of q and k (the bandwidth bound), the Triton
kernel, the composite eager, and the composite compiled (inductor, dynamic=False), with each result checked
against upstream's.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_check import cuda_ms  # noqa: E402  (beside this script)
from rope import SHAPES, inputs  # noqa: E402

from tfcompat.rope import apply_rope  # noqa: E402


def row(name, tokens, dev):
    config, cos, sin, q, k, gq, gk = inputs(name, tokens, torch.bfloat16, dev)

    def rope(impl):
        return lambda a=q, b=k: apply_rope(a, b, cos, sin, config=config, impl=impl)

    compiled = torch.compile(lambda a, b: apply_rope(a, b, cos, sin, config=config, impl="composite"), dynamic=False)
    want = rope("upstream")()
    diffs = {impl: max((a.float() - b.float()).abs().max().item() for a, b in zip(fn(), want))
             for impl, fn in (("triton", rope("triton")), ("compiled", lambda: compiled(q, k)))}

    def fwd_bwd(fn):
        def setup():
            return q.detach().clone().requires_grad_(True), k.detach().clone().requires_grad_(True)

        return cuda_ms(lambda a, b: torch.autograd.backward(fn(a, b), (gq, gk)), setup=setup)

    r = {"copy": cuda_ms(lambda: (q.clone(), k.clone())), "triton": cuda_ms(rope("triton")),
         "composite": cuda_ms(rope("composite")), "compiled": cuda_ms(lambda: compiled(q, k)),
         "fb_triton": fwd_bwd(lambda a, b: apply_rope(a, b, cos, sin, config=config, impl="triton")),
         "fb_compiled": fwd_bwd(compiled)}
    print(f"{name:<14}{tokens:>7}{r['copy']:8.3f}{r['triton']:8.3f}{r['composite']:8.3f}{r['compiled']:9.3f}"
          f"{r['compiled'] / r['triton']:10.2f}{r['fb_triton']:8.3f}{r['fb_compiled']:9.3f}"
          f"{r['fb_compiled'] / r['fb_triton']:10.2f}  max|diff| vs upstream: triton {diffs['triton']:.3g}, "
          f"compiled {diffs['compiled']:.3g}", flush=True)


def main():
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 2
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, bf16; milliseconds (median of 20)")
    print(f"{'shape':<14}{'tokens':>7}{'copy':>8}{'triton':>8}{'comp':>8}{'comp+ind':>9}{'ind/tri':>10}"
          f"{'fb tri':>8}{'fb ind':>9}{'fb i/t':>10}")
    for name in SHAPES:
        for tokens in (16384, 65536):
            row(name, tokens, torch.device("cuda"))
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
