"""Peak memory of the dummy visual forward against the text-only embedding path.

    python bench/embeds_memory.py [--family qwen3_vl] [--tokens 32768] [--hidden 2048]

Each path runs in a fresh subprocess (embeddings -> a stand-in loss -> backward) and reports its
peak resident memory; the extra memory of the dummy path is printed in units of one
``inputs_embeds`` tensor (the target is at most 1.0).
"""

import argparse
import json
import resource
import subprocess
import sys


def child(mode, family, tokens, hidden):
    import torch

    from tfcompat.embeds import get_input_embeds
    from tfcompat.testing import tiny_model

    # the tiny vision tower's output width follows the text hidden size (tfcompat.testing)
    model = tiny_model(family, hidden_size=hidden, num_attention_heads=hidden // 32)
    model.train()
    ids = torch.randint(10, 240, (1, tokens))
    torch.set_grad_enabled(True)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if mode == "text":
        embeds = model.get_input_embeddings()(ids)
    else:
        embeds = get_input_embeds(model, ids).inputs_embeds
    embeds.float().sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"delta_kib": peak - base, "embeds_kib": embeds.numel() * embeds.element_size() / 1024}))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="qwen3_vl")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--child", default=None)
    args = p.parse_args()
    if args.child:
        return child(args.child, args.family, args.tokens, args.hidden)
    runs = {}
    for mode in ("text", "dummy"):
        out = subprocess.run([sys.executable, __file__, "--child", mode, "--family", args.family, "--tokens",
                              str(args.tokens), "--hidden", str(args.hidden)], capture_output=True, text=True,
                             check=True)
        runs[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    size = runs["text"]["embeds_kib"]
    extra = runs["dummy"]["delta_kib"] - runs["text"]["delta_kib"]
    print(f"{args.family}: inputs_embeds {size / 1024:.0f} MiB ({args.tokens} tokens x {args.hidden})")
    print(f"{'path':<8}{'peak growth MiB':>16}")
    for mode in ("text", "dummy"):
        print(f"{mode:<8}{runs[mode]['delta_kib'] / 1024:16.0f}")
    print(f"dummy extra: {extra / 1024:.0f} MiB = {extra / size:.2f} x inputs_embeds (target <= 1.0)")


if __name__ == "__main__":
    main()
