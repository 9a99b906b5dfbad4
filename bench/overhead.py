"""Host overhead of the patched path: a tiny model's packed step against the unpatched model's step on the
same row, forward + backward.

    python bench/overhead.py [--family qwen2] [--layers 4] [--hidden 64] [--tokens 256] [--sequences 1,4]
                             [--repeats 30]

Text families only (the tiny VL configs fix their head_dim through their mRoPE sections).

At this size the step is launch- and Python-bound, so the ratio is tfcompat's per-step and per-layer host
work (step validation, the rotary carry, the per-layer forwards) against upstream's own. The variants are
interleaved (patched, unpatched, patched, ...) and timed by CPU time of this process (one thread), robust to
a busy neighbour; the lower quartile and the spread (upper / lower quartile) are printed. Targets (issue 32):
the patched step over the unpatched one <= 1.0 on one sequence (the patched model detects it and runs upstream's
own path) and <= 0.95 on 4 (attention per sequence; the per-layer code prepared once per step).

The unpatched model runs the same row as one sequence (positions 0..n-1, no boundaries): the same matmuls,
attention over the whole row instead of per sequence (negligible at this size).
"""

import argparse
import statistics
import time

import torch

import tfcompat
from tfcompat.testing import tiny_model


def _quartiles(xs):
    q = statistics.quantiles(xs, n=4)
    return q[0], q[2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="qwen2")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--sequences", default="1,4", help="comma-separated sequence counts of the packed row")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)

    over = dict(num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=2 * args.hidden)
    plain = tiny_model(args.family, **over).train()
    patched = tiny_model(args.family, **over).train()
    tfcompat.patch(patched)
    n = args.tokens
    ids = torch.randint(10, 200, (1, n), generator=torch.Generator().manual_seed(0))
    row_pos = torch.arange(n)[None]

    def step(model, **kw):
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, **kw).logits.float().sum().backward()

    runs = {"unpatched, one row": lambda: step(plain, position_ids=row_pos)}
    counts = [int(c) for c in args.sequences.split(",")]
    for k in counts:
        bounds = [round(i * n / k) for i in range(k + 1)]
        cu = torch.tensor(bounds, dtype=torch.int32)
        pos = torch.cat([torch.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:])])[None]
        longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        runs[f"patched, {k} seq (position ids)"] = lambda pos=pos: step(patched, position_ids=pos)
        runs[f"patched, {k} seq (cu_seq_lens)"] = lambda pos=pos, cu=cu, longest=longest: step(
            patched, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest)
    for fn in runs.values():  # warm up: resolutions, allocator, autograd graph caches
        fn()
        fn()
    times = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():  # interleaved: a busy neighbour slows every variant alike
            start = time.process_time()
            fn()
            times[name].append(time.process_time() - start)

    base_lo, _ = _quartiles(times["unpatched, one row"])
    print(f"torch {torch.__version__}, {args.family}, {args.layers} layers, hidden {args.hidden}, {n} tokens in "
          f"{args.sequences} sequences, forward+backward, CPU time, {args.repeats} interleaved repeats, 1 thread")
    print(f"{'variant':<34} {'q1 ms':>8} {'q3/q1':>6} {'ratio':>6} {'extra per layer us':>19}")
    for name, xs in times.items():
        lo, hi = _quartiles(xs)
        extra = (lo - base_lo) / args.layers * 1e6
        print(f"{name:<34} {lo * 1e3:8.2f} {hi / lo:6.2f} {lo / base_lo:6.2f} {extra:19.0f}")


if __name__ == "__main__":
    main()
