"""Packed (patched, remove padding) vs padded (upstream) forward+backward at ~50% padding.

    python bench/attention.py [--family qwen2_vl] [--batch 8] [--max-len 512] [--repeats 5]

Both runs use the same tiny-but-not-trivial model (hidden 256, 4 layers, 8 heads) and the same
tokens; the padded batch has every sequence padded to the longest. Prints medians and the ratio.
"""

import argparse
import statistics
import time

import torch

import tfcompat
from tfcompat._families import family
from tfcompat.packing import pack, unpack
from tfcompat.testing import tiny_model


def timed(fn, repeats):
    out = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return statistics.median(out[1:]) * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="qwen2_vl")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    over = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=2, vocab_size=1024)
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
        (logits.float() * mask[..., None]).square().mean().backward()

    def packed_step():
        model.zero_grad(set_to_none=True)
        logits = unpack(model(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False).logits, pk)
        (logits.float() * mask[..., None]).square().mean().backward()

    t_padded = timed(padded_step, args.repeats)
    tfcompat.patch(model)
    t_packed = timed(packed_step, args.repeats)
    tfcompat.unpatch(model)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {args.family}, batch {args.batch}, "
          f"max len {args.max_len}, padding {padding:.0%}, median of {args.repeats}")
    print(f"{'padded (upstream) ms':>22}{'packed (tfcompat) ms':>22}{'speed-up':>10}")
    print(f"{t_padded:22.1f}{t_packed:22.1f}{t_padded / t_packed:10.2f}x")


if __name__ == "__main__":
    main()
