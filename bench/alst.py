"""tfcompat's Ulysses beside DeepSpeed's ALST (``UlyssesSPAttentionHF``, what accelerate's
``ParallelismConfig(sp_backend="deepspeed")`` drives from the Trainer), same model, same rows, in one run:
exactness against the single-process padded model (logits and gradients summed over the ranks) and the step
time per rank (forward + backward), as ratios tfcompat / ALST.

    python bench/alst.py                      # 2 gloo ranks on the CPU (DeepSpeed installed: see below)
    python bench/alst.py --ranks 4 --tokens 4096
    python bench/alst.py --json               # the numbers as JSON (tests/test_alst.py reads them)

Rows: a packed row of 4 sequences (what a padding-free collator hands the model), one long sequence (no
packing: where both are exact and speed is the question), and Qwen2.5-VL's packed row with 3-row mRoPE
position ids. Both run the model's SDPA attention; ALST replaces transformers' "sdpa" attention function in
the process, so tfcompat runs first. DeepSpeed on this CPU-only machine: ``DS_BUILD_OPS=0
DS_SKIP_CUDA_CHECK=1 pip install deepspeed`` (0.19.8 measured; its Ulysses runs over gloo).
"""

import argparse
import json
import statistics
import time

import _ranks  # bench/_ranks.py: the folder of the script run is on sys.path
import torch
import torch.distributed as dist

import tfcompat
from tfcompat.packing import pack, unpack
from tfcompat.testing import padded_batch, tiny_model, tiny_sequence
from tfcompat.ulysses import gather_from_ranks, slice_for_rank


def _model(name, args, attn="sdpa"):
    torch.manual_seed(0)
    extra = {} if name.endswith("_vl") else dict(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                                  num_hidden_layers=args.layers, num_attention_heads=8,
                                                  num_key_value_heads=2, head_dim=args.hidden // 8)
    model = tiny_model(name, **extra)
    model.config._attn_implementation = attn
    for m in model.modules():
        if hasattr(m, "config"):
            m.config._attn_implementation = attn
    return model.train()


def _text(n, seed):
    return torch.randint(3, 240, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _rows(name, case, tokens):
    if case == "long":
        return [_text(tokens, 0)]
    if name == "qwen2_5_vl":
        return [tiny_sequence(name, text=11, image=True), tiny_sequence(name, text=7),
                tiny_sequence(name, text=5, image=True), tiny_sequence(name, text=9)]
    share = tokens // 4
    return [_text(share + 3, 1), _text(share - 5, 2), _text(share + 1, 3), _text(share + 1, 4)]


def _reference(name, case, args):
    """The unpatched model on the padded rows: logits (valid positions), the weights of the loss, gradients."""
    from tfcompat.embeds import rope_index
    from tfcompat.testing import tiny_pixels

    vision = name == "qwen2_5_vl"
    ids, mask = padded_batch(_rows(name, case, args.tokens))
    pixels = tiny_pixels(2) if vision else {}
    model = _model(name, args, attn="eager")  # not "sdpa": ALST replaces that function in the process
    ref = model(input_ids=ids, attention_mask=mask, use_cache=False, **_vl_kwargs(model, ids, pixels)).logits
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    (ref * weights * mask[..., None]).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    pos = rope_index(model, ids, image_grid_thw=pixels.get("image_grid_thw"), attention_mask=mask)[0] \
        if vision else None
    pk = pack(ids, mask, pos, vision=vision)
    return ids, mask, _vl_kwargs(model, pk.input_ids, pixels), ref.detach(), weights, grads, pk


def _vl_kwargs(model, ids, pixels):
    """The pixels and, where the model takes them, the processor's ``mm_token_type_ids`` (Qwen2.5-VL on 5.x
    computes other mRoPE positions without them: the processor's call is the one to compare)."""
    from tfcompat._tools.checks import _forward_kwargs

    return _forward_kwargs(model, ids, pixels)


def _diff(model, logits, ref, mask, grads):
    valid = mask.bool()
    out = (logits[valid] - ref[valid]).abs().max().item() / max(1.0, ref.abs().max().item())
    for n, p in model.named_parameters():
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        if n in grads:
            out = max(out, (g - grads[n]).abs().max().item() / max(1.0, grads[n].abs().max().item()))
    return out


def _timed(step, repeats):
    step()  # warm-up
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    slowest = torch.tensor([statistics.median(times)])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def _tfcompat(name, case, args, world):
    ids, mask, pixels, ref, weights, grads, pk = _reference(name, case, args)
    model = _model(name, args)
    vision = name == "qwen2_5_vl"
    tfcompat.patch(model, ulysses_group=dist.group.WORLD, slice_inputs=vision)
    total = pk.input_ids.shape[1]

    def step():
        model.zero_grad(set_to_none=True)
        if vision:  # the whole row on every rank; the model keeps its share after embedding
            local = model(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False, **pixels).logits
        else:
            local = model(input_ids=slice_for_rank(pk.input_ids, 1), use_cache=False,
                          position_ids=slice_for_rank(pk.position_ids, pk.position_ids.dim() - 1)).logits
        logits = unpack(gather_from_ranks(local, 1, length=total), pk)
        (logits * weights * mask[..., None]).sum().backward()
        return logits.detach()

    logits = step()
    return _diff(model, logits, ref, mask, grads), _timed(step, args.repeats)


def _alst(name, case, args, world):
    ids, mask, pixels, ref, weights, grads, pk = _reference(name, case, args)
    model = _model(name, args)
    total = pk.input_ids.shape[1]
    pad = -total % world
    row = torch.nn.functional.pad(pk.input_ids, (0, pad))
    pos = torch.nn.functional.pad(pk.position_ids, (0, pad))
    share = row.shape[1] // world
    rank = dist.get_rank()

    def step():
        model.zero_grad(set_to_none=True)
        local = model(input_ids=row[:, rank * share:(rank + 1) * share], use_cache=False,
                      position_ids=pos[..., rank * share:(rank + 1) * share], **pixels).logits
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local.contiguous())
        parts[rank] = local  # this rank's slice keeps its graph (the gradient of the others is theirs)
        logits = unpack(torch.cat(parts, 1)[:, :total], pk)
        (logits * weights * mask[..., None]).sum().backward()
        return logits.detach()

    try:
        logits = step()
    except Exception as exc:
        return f"refused: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}", None
    return _diff(model, logits, ref, mask, grads), _timed(step, args.repeats)


CASES = (("qwen3", "packed"), ("qwen3", "long"), ("qwen2_5_vl", "packed"))


def _worker(rank, world, args):
    out = {}
    for name, case in CASES:
        out[f"{name}/{case}"] = {"tfcompat": _tfcompat(name, case, args, world)}
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    deepspeed.init_distributed(dist_backend="gloo")
    UlyssesSPAttentionHF.register_with_transformers(_model("qwen3", args), "sdpa", world, 1)
    for name, case in CASES:
        out[f"{name}/{case}"]["alst"] = _alst(name, case, args, world)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of the long sequence and the packed row")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the measurements as one JSON object")
    args = parser.parse_args()
    out = _ranks.run(_worker, args.ranks, args)
    if args.json:  # {"family/rows": {"tfcompat": [rel.err, seconds], "alst": [rel.err or "refused: ...", seconds]}}
        print(json.dumps(out))
        return
    print(f"{args.ranks} gloo ranks, Qwen3 8/2 heads hidden {args.hidden} x {args.layers} layers, {args.tokens} "
          f"tokens; Qwen2.5-VL tiny; fp32, SDPA; step = forward + backward, median of {args.repeats}, slowest rank")
    print(f"{'rows':<20} {'tfcompat rel.err':>16} {'ALST rel.err':>16} {'tfcompat/ALST time':>19}")
    refusals = []
    for key, got in out.items():
        (t_err, t_time), (a_err, a_time) = got["tfcompat"], got["alst"]
        if not isinstance(a_err, float):
            refusals.append(f"{key}: ALST {a_err}")
        a_text = f"{a_err:.2e}" if isinstance(a_err, float) else "refused (below)"
        ratio = f"{t_time / a_time:.2f}x" if a_time else "-"
        print(f"{key:<20} {t_err:>16.2e} {a_text:>16} {ratio:>19}")
    for line in refusals:
        print(line)


if __name__ == "__main__":
    main()
