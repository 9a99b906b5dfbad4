"""apply_rope speed: native vs upstream, against memory-bandwidth anchors, side by side in one process.

    python bench/rope.py [--tokens 16384] [--repeats 7]

Prints medians (ms) and ratios: native / upstream, and in-place / (q.clone() + k.clone()).
Shapes: Qwen2.5-VL-7B (28 q heads, 4 kv heads, head_dim 128, full rotary, NeoX halves, mRoPE) and
GLM-4.1V-9B (32 q heads, 2 kv heads, head_dim 128, half rotary, GPT-J pairs, mRoPE).
"""

import argparse
import statistics
import time

import torch

from tfcompat import _resolve
from tfcompat.config import text_config
from tfcompat.rope import apply_rope, apply_rope_
from tfcompat.testing import tiny_config

SHAPES = {
    # name: (family, q heads, kv heads, head_dim, mrope_section)
    "qwen2.5-vl-7b": ("qwen2_5_vl", 28, 4, 128, [16, 24, 24]),
    "glm-4.1v-9b": ("glm4v", 32, 2, 128, [8, 12, 12]),
}


def _config(family, head_dim, section):
    over = dict(hidden_size=head_dim * 4, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim)
    key = _resolve.resolve("rope.init", family).plan.config_key
    config = tiny_config(family, **over)
    rope = text_config(config).__dict__.get(key) or text_config(config).__dict__.get("rope_scaling")
    rope["mrope_section"] = list(section)
    return config


def median_ms(fn, repeats, setup=None):
    times = []
    for _ in range(repeats + 1):
        args = setup() if setup else ()
        start = time.perf_counter()
        fn(*args)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


def inputs(name, tokens, dtype, device="cpu"):
    """config, cos, sin (as the release's rotary module returns them), q, k (projection views), gq, gk."""
    family, hq, hkv, head_dim, section = SHAPES[name]
    config = _config(family, head_dim, section)
    rot = _resolve.resolve("rope.init", family).target(config=text_config(config)).to(device)
    g = torch.Generator(device=device).manual_seed(0)
    pos = torch.randint(0, 4096, (3, 1, tokens), generator=g, device=device)
    cos, sin = rot(torch.zeros(1, dtype=dtype, device=device), pos)
    # q/k as the attention has them: (b, s, h, d) projections viewed as (b, h, s, d)
    q = torch.randn(1, tokens, hq, head_dim, generator=g, device=device).to(dtype).transpose(1, 2)
    k = torch.randn(1, tokens, hkv, head_dim, generator=g, device=device).to(dtype).transpose(1, 2)
    return config, cos, sin, q, k, torch.randn_like(q), torch.randn_like(k)


def bench(name, tokens, dtype, repeats):
    config, cos, sin, q, k, gq, gk = inputs(name, tokens, dtype)
    out_q, out_k = torch.empty_like(q), torch.empty_like(k)

    r = {}
    r["clone"] = median_ms(lambda: (q.clone(), k.clone()), repeats)
    r["copy_"] = median_ms(lambda: (out_q.copy_(q), out_k.copy_(k)), repeats)
    r["upstream"] = median_ms(lambda: apply_rope(q, k, cos, sin, config=config, impl="upstream"), repeats)
    r["native"] = median_ms(lambda: apply_rope(q, k, cos, sin, config=config, impl="native"), repeats)
    r["inplace"] = median_ms(lambda a, b: apply_rope_(a, b, cos, sin, config=config), repeats,
                             setup=lambda: (q.clone(), k.clone()))

    def fwd_bwd(impl):
        def setup():
            return q.detach().clone().requires_grad_(True), k.detach().clone().requires_grad_(True)

        def run(a, b):
            oq, ok = apply_rope(a, b, cos, sin, config=config, impl=impl)
            torch.autograd.backward((oq, ok), (gq, gk))

        return median_ms(run, repeats, setup)

    r["upstream_fb"] = fwd_bwd("upstream")
    r["native_fb"] = fwd_bwd("native")
    return r


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    args = parser.parse_args()
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, threads {torch.get_num_threads()}, "
          f"{args.tokens} tokens, median of {args.repeats}")
    head = (f"{'shape':<15}{'dtype':<6}{'clone ms':>9}{'upstr ms':>9}{'native':>8}{'inplace':>8}"
            f"{'nat/up':>8}{'inpl/clone':>11}{'fb up ms':>9}{'fb nat':>8}{'fb nat/up':>10}")
    print(head)
    for name in args.shapes:
        for dtype in (torch.float32, torch.bfloat16):
            r = bench(name, args.tokens, dtype, args.repeats)
            print(f"{name:<15}{str(dtype).split('.')[-1]:<6}{r['clone']:9.1f}{r['upstream']:9.1f}{r['native']:8.1f}"
                  f"{r['inplace']:8.1f}{r['native'] / r['upstream']:8.2f}{r['inplace'] / r['clone']:11.2f}"
                  f"{r['upstream_fb']:9.1f}{r['native_fb']:8.1f}{r['native_fb'] / r['upstream_fb']:10.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
