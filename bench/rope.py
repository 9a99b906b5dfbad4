"""apply_rope speed: native vs upstream, against memory-bandwidth anchors, side by side in one process.

    python bench/rope.py [--tokens 16384] [--repeats 7]

Prints, per variant, the lower quartile (ms) of ``--repeats`` runs, and ratios of lower quartiles: native /
upstream, in-place / (q.clone() + k.clone()). The variants of a row run interleaved (one round runs each once),
so a busy neighbour slows them alike; the last column is the largest spread (upper / lower quartile) of the
row's variants: above ~1.3 the machine was noisy and the row should be rerun.
Shapes: Qwen2.5-VL-7B (28 q heads, 4 kv heads, head_dim 128, full rotary, NeoX halves, mRoPE) and
GLM-4.1V-9B (32 q heads, 2 kv heads, head_dim 128, half rotary, GPT-J pairs, mRoPE).
"""

import argparse
import statistics
import time

import torch

from tfcompat._probe import resolve as _resolve
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


def interleaved_ms(variants, repeats):
    """{name: (lower quartile ms, upper / lower quartile)} of ``(fn, setup)`` variants run round-robin; the
    first round warms up and is dropped."""
    times = {name: [] for name in variants}
    for round_ in range(repeats + 1):
        for name, (fn, setup) in variants.items():
            args = setup() if setup else ()
            start = time.perf_counter()
            fn(*args)
            if round_:
                times[name].append((time.perf_counter() - start) * 1e3)
    out = {}
    for name, xs in times.items():
        q1, _, q3 = statistics.quantiles(xs, n=4) if len(xs) > 1 else (xs[0], xs[0], xs[0])
        out[name] = (q1, q3 / q1)
    return out


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

    def grads():
        return q.detach().clone().requires_grad_(True), k.detach().clone().requires_grad_(True)

    def fwd_bwd(impl):
        def run(a, b):
            oq, ok = apply_rope(a, b, cos, sin, config=config, impl=impl)
            torch.autograd.backward((oq, ok), (gq, gk))

        return run, grads

    variants = {
        "clone": (lambda: (q.clone(), k.clone()), None),
        "copy_": (lambda: (out_q.copy_(q), out_k.copy_(k)), None),
        "upstream": (lambda: apply_rope(q, k, cos, sin, config=config, impl="upstream"), None),
        "native": (lambda: apply_rope(q, k, cos, sin, config=config, impl="native"), None),
        "inplace": (lambda a, b: apply_rope_(a, b, cos, sin, config=config), lambda: (q.clone(), k.clone())),
        "upstream_fb": fwd_bwd("upstream"),
        "native_fb": fwd_bwd("native"),
    }
    timed = interleaved_ms(variants, repeats)
    r = {name: q1 for name, (q1, _) in timed.items()}
    r["spread"] = max(spread for _, spread in timed.values())
    return r


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    args = parser.parse_args()
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, threads {torch.get_num_threads()}, "
          f"{args.tokens} tokens, lower quartile of {args.repeats} interleaved runs")
    head = (f"{'shape':<15}{'dtype':<6}{'clone ms':>9}{'upstr ms':>9}{'native':>8}{'inplace':>8}"
            f"{'nat/up':>8}{'inpl/clone':>11}{'fb up ms':>9}{'fb nat':>8}{'fb nat/up':>10}{'spread':>7}")
    print(head)
    for name in args.shapes:
        for dtype in (torch.float32, torch.bfloat16):
            r = bench(name, args.tokens, dtype, args.repeats)
            print(f"{name:<15}{str(dtype).split('.')[-1]:<6}{r['clone']:9.1f}{r['upstream']:9.1f}{r['native']:8.1f}"
                  f"{r['inplace']:8.1f}{r['native'] / r['upstream']:8.2f}{r['inplace'] / r['clone']:11.2f}"
                  f"{r['upstream_fb']:9.1f}{r['native_fb']:8.1f}{r['native_fb'] / r['upstream_fb']:10.2f}"
                  f"{r['spread']:7.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
