"""What ``tfcompat.patch`` buys on the installed transformers: for text and VL families, whether the unpatched
model is already exact on a packed row, whether the patched one is, and their step times side by side.

    python bench/patch_buys.py [--families qwen2,qwen3,glm4,qwen2_vl,qwen2_5_vl,qwen3_vl,glm4v] [--scale 1]
                               [--repeats 5]

The packed row holds 4 sequences of 7, 5, 9 and 4 text tokens times ``--scale`` (an image in two of them for VL
families) and is fed as transformers'
padding-free collator feeds it (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``): input_ids,
position ids counting from 0 in every sequence (VL: ``tfcompat.packing.pack``'s 4-row ids, the text row first,
which transformers 5.x VL models take), and ``cu_seq_lens_q/k``, ``max_length_q/k``. The oracle is the same
unpatched model on the padded batch (one sequence per row, its mask). ``max rel`` is the largest
|packed - padded| over the real tokens' logits divided by the largest |padded| logit; ``raises`` names what
upstream raised instead. Times are forward + backward (sum of the logits), the lower quartile of interleaved
runs, unpatched packed and patched packed; tiny random-weight models, fp32, CPU, SDPA (the default attention).
"""

import argparse
import inspect
import statistics
import time

import torch

import tfcompat
from tfcompat.embeds import mm_token_type_ids, rope_index
from tfcompat.packing import pack
from tfcompat.testing import padded_batch, tiny_model, tiny_pixels, tiny_sequence
from tfcompat.version import transformers_version

FAMILIES = "qwen2,qwen3,glm4,qwen2_vl,qwen2_5_vl,qwen3_vl,glm4v"


def _vision(model):
    return hasattr(model.config, "vision_config")


def _batch(name, model, scale):
    vl = _vision(model)
    def more(n):  # text tokens beyond the tiny sequence's own (ids below the vocabulary's special tokens)
        return [10 + i % 200 for i in range(n * (scale - 1))]

    rows = [tiny_sequence(name, text=7, image=vl) + more(7), tiny_sequence(name, text=5) + more(5),
            tiny_sequence(name, text=9) + more(9), tiny_sequence(name, text=4, image=vl, image_first=True) + more(4)]
    ids, mask = padded_batch(rows)
    pixels = tiny_pixels(2 if vl else 0)
    pos = None
    if vl:
        pos, _ = rope_index(model, ids, image_grid_thw=pixels["image_grid_thw"], attention_mask=mask)
    return ids, mask, pixels, pos


def _extra(model, ids):
    """mm_token_type_ids where this release's forward takes it (5.3+ VL forwards need it with pixels)."""
    params = inspect.signature(type(model).forward).parameters
    return {"mm_token_type_ids": mm_token_type_ids(model, ids)} if _vision(model) and \
        "mm_token_type_ids" in params else {}


def _quartile(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append((time.process_time() - start) * 1e3)
    return statistics.quantiles(times, n=4)[0] if len(times) > 1 else times[0]


def measure(name, repeats, scale):
    model = tiny_model(name)
    ids, mask, pixels, pos = _batch(name, model, scale)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, use_cache=False, **pixels, **_extra(model, ids)).logits
    want = want[mask.bool()]
    pk = pack(ids, mask, pos, vision=_vision(model))
    call = dict(input_ids=pk.input_ids, position_ids=pk.position_ids, cu_seq_lens_q=pk.cu_seqlens,
                cu_seq_lens_k=pk.cu_seqlens, max_length_q=pk.max_seqlen, max_length_k=pk.max_seqlen,
                use_cache=False, **pixels, **_extra(model, pk.input_ids))

    def step(m):
        m.zero_grad(set_to_none=True)
        m(**call).logits.sum().backward()

    def rel(m):
        with torch.no_grad():
            got = m(**call).logits[0]
        return float((got - want).abs().max() / want.abs().max())

    try:
        upstream = f"{rel(model):.1e}"
        up_ms = _quartile(lambda: step(model), repeats)
    except Exception as exc:  # upstream's own refusal of the packed call, named
        upstream, up_ms = f"raises {type(exc).__name__}", None
    patched = tiny_model(name)
    tfcompat.patch(patched)
    ours = rel(patched)
    ours_ms = _quartile(lambda: step(patched), repeats)
    return upstream, ours, up_ms, ours_ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=FAMILIES)
    ap.add_argument("--scale", type=int, default=1, help="times the text tokens of every sequence")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from tfcompat._probe.resolve import installed_families

    have = installed_families()
    print(f"transformers {transformers_version()}, torch {torch.__version__}, fp32 CPU, 1 thread, text x{args.scale}, "
          f"lower quartile of {args.repeats} runs")
    print(f"{'family':<12} {'unpatched max rel':>20} {'patched max rel':>16} {'unpatched ms':>13} {'patched ms':>11} "
          f"{'ratio':>6}")
    for name in args.families.split(","):
        if name not in have:
            print(f"{name:<12} {'(not in this release)':>20}")
            continue
        upstream, ours, up_ms, ours_ms = measure(name, args.repeats, args.scale)
        ratio = f"{ours_ms / up_ms:6.2f}" if up_ms else f"{'-':>6}"
        up = f"{up_ms:13.1f}" if up_ms else f"{'-':>13}"
        print(f"{name:<12} {upstream:>20} {ours:16.1e} {up} {ours_ms:11.1f} {ratio}")


if __name__ == "__main__":
    main()
