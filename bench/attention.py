"""Packed (patched, remove padding) vs padded (upstream) vs one sequence at a time (upstream), forward+backward.

    python bench/attention.py [--family qwen2_vl] [--batch 8] [--max-len 512] [--hidden 256] [--layers 4]
    python bench/attention.py --hidden 1024 --layers 2 --max-len 2048 --repeats 3   # realistic sizes

All runs use the same model and the same tokens, lengths spread evenly (~50% padding): the padded batch
has every sequence padded to the longest; "one at a time" runs each sequence alone through upstream, with
no padding (what a framework without packing does at batch 1). Prints lower quartiles of interleaved runs
(one round runs each variant once), the largest spread (upper / lower quartile), and the ratios
packed/padded and packed/one-at-a-time (target: packed <= one at a time, since packing runs the linear
layers on all tokens at once).

On CPU the packed row's activations are large (tens of MB each): glibc's malloc hands such blocks out by
mmap and back on free, so every fresh activation page-faults (a 67 MB elementwise product: ~36 ms with the
default allocator, 5 ms into reused memory). One sequence at a time works on blocks small enough to stay in
the heap. Keep large blocks in the heap for a like-for-like comparison (what jemalloc or tcmalloc, the
allocators PyTorch's CPU tuning guide recommends, do by themselves):

    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 MALLOC_TOP_PAD_=1000000000 python bench/attention.py ...

The first line printed names the allocator settings the run had.
"""

import argparse
import os
import statistics
import time

import torch

import tfcompat
from tfcompat._probe.families import family
from tfcompat.packing import pack
from tfcompat.testing import tiny_model


def interleaved(variants, repeats):
    """{name: (lower quartile ms, upper / lower quartile)}: one round runs every variant once (a busy
    neighbour slows them alike); the first round warms up and is dropped."""
    times = {name: [] for name in variants}
    for round_ in range(repeats + 1):
        for name, (fn, prepare) in variants.items():
            prepare()
            start = time.perf_counter()
            fn()
            if round_:
                times[name].append((time.perf_counter() - start) * 1e3)
    out = {}
    for name, xs in times.items():
        q1, q3 = (statistics.quantiles(xs, n=4)[0], statistics.quantiles(xs, n=4)[2]) if len(xs) > 1 else (xs[0],) * 2
        out[name] = (q1, q3 / q1)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="qwen2_vl")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args()
    heads = max(8, args.hidden // 128)
    over = dict(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                num_attention_heads=heads, num_key_value_heads=2, head_dim=args.hidden // heads, vocab_size=1024)
    model = tiny_model(args.family, **over).train()
    g = torch.Generator().manual_seed(0)
    # lengths spread evenly so that about half of the padded batch is padding
    lengths = torch.linspace(1, args.max_len, args.batch).round().long()
    ids = torch.randint(10, 240, (args.batch, args.max_len), generator=g)
    mask = (torch.arange(args.max_len)[None] < lengths[:, None]).long()
    padding = 1 - mask.float().mean().item()
    vision = family(args.family).vision
    pk = pack(ids, mask, vision=vision)

    def padded_step():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        ((logits.float() * mask[..., None]).square().sum() / mask.sum()).backward()

    # the same loss in all three steps (squares of the valid tokens' logits over their count), each computed
    # where a training loop has it: packed logits stay packed (labels are packed alongside)
    def packed_step():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False).logits
        (logits.float().square().sum() / mask.sum()).backward()

    def one_at_a_time_step():
        model.zero_grad(set_to_none=True)
        for row, n in zip(ids, lengths.tolist()):
            logits = model(input_ids=row[None, :n], use_cache=False).logits
            (logits.float().square().sum() / mask.sum()).backward()

    def unpatched():
        tfcompat.unpatch(model)

    def patched():
        tfcompat.patch(model)

    timed = interleaved({"padded": (padded_step, unpatched), "one": (one_at_a_time_step, unpatched),
                         "packed": (packed_step, patched)}, args.repeats)
    tfcompat.unpatch(model)
    t_padded, t_single, t_packed = (timed[n][0] for n in ("padded", "one", "packed"))
    spread = max(s for _, s in timed.values())
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {args.family}, hidden {args.hidden}, "
          f"{args.layers} layers, batch {args.batch}, max len {args.max_len}, padding {padding:.0%}, "
          f"lower quartile of {args.repeats} interleaved runs")
    tuned = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_") or k == "LD_PRELOAD"}
    print("allocator:", " ".join(f"{k}={v}" for k, v in sorted(tuned.items())) or "glibc defaults")
    print(f"{'padded ms':>11}{'one at a time ms':>18}{'packed ms':>11}{'packed/padded':>15}{'packed/one':>12}"
          f"{'spread':>8}")
    print(f"{t_padded:11.1f}{t_single:18.1f}{t_packed:11.1f}{t_packed / t_padded:15.2f}{t_packed / t_single:12.2f}"
          f"{spread:8.2f}")


if __name__ == "__main__":
    main()
