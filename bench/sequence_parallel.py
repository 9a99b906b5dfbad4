"""Ulysses alone vs context parallel vs both (2-D), same model, same packed row: per-rank activation memory
and step time (forward+backward), as ratios to Ulysses alone.

    python bench/sequence_parallel.py                       # 4 gloo ranks on the CPU
    python bench/sequence_parallel.py --tokens 16384 --hidden 1024 --layers 4
    torchrun --nproc-per-node 4 bench/sequence_parallel.py --nccl   # GPUs

Memory: on the CPU, the bytes of the tensors autograd saves for backward on each rank (what activation
memory is made of; ``saved_tensors_hooks``); on CUDA, ``torch.cuda.max_memory_allocated`` of the step.
Time: the median of ``--repeats`` steps after one warm-up, the slowest rank's. Every layout computes the
same numbers (tests/test_context.py proves it); this measures what each costs.
"""

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tfcompat
from tfcompat.packing import pack
from tfcompat.testing import tiny_model
from tfcompat.ulysses import slice_for_rank

LAYOUTS = ("ulysses", "context", "both")


def _groups(layout, world):
    """(ulysses group, context group) for this layout over ``world`` ranks (both: ulysses 2 x context world/2)."""
    if layout == "ulysses":
        return dist.group.WORLD, None
    if layout == "context":
        return None, dist.group.WORLD
    from torch.distributed.device_mesh import init_device_mesh

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device, (world // 2, 2), mesh_dim_names=("cp", "sp"))
    return mesh["sp"].get_group(), mesh["cp"].get_group()


def _step_stats(model, ids, pos, split, repeats, device):
    saved = [0]

    def pack_hook(t):
        saved[0] += t.numel() * t.element_size()
        return t

    times, peak = [], 0
    for i in range(repeats + 1):
        saved[0] = 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
            out = model(input_ids=slice_for_rank(ids, dim=1, **split),
                        position_ids=slice_for_rank(pos, dim=1, **split)).logits
        out.float().pow(2).mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        if i:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times), (peak if device.type == "cuda" else saved[0])


def _worker(rank, world, init, args, backend):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if init is not None:
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=600))
    device = torch.device("cuda", rank % torch.cuda.device_count()) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    heads = max(8, args.hidden // 128)
    over = dict(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                num_attention_heads=heads, num_key_value_heads=2, head_dim=args.hidden // heads, vocab_size=1024)
    lengths = [args.tokens // 8, args.tokens // 4, args.tokens // 2 - args.tokens // 8,
               args.tokens - args.tokens // 2 - args.tokens // 4]
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(10, 1000, (n,), generator=g) for n in lengths]
    width = max(lengths)
    padded = torch.zeros(len(ids), width, dtype=torch.long)
    mask = torch.zeros_like(padded)
    for i, row in enumerate(ids):
        padded[i, : len(row)] = row
        mask[i, : len(row)] = 1
    pk = pack(padded, mask)
    results = {}
    for layout in LAYOUTS:
        u, c = _groups(layout, world)
        split = {k: v for k, v in (("group", u), ("context_group", c)) if v is not None}
        model = tiny_model(args.family, **over).to(device).train()
        tfcompat.patch(model, ulysses_group=u, context_group=c)
        seconds, memory = _step_stats(model, pk.input_ids.to(device), pk.position_ids.to(device), split,
                                      args.repeats, device)
        both = torch.tensor([seconds, float(memory)], dtype=torch.float64, device=device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)  # the slowest rank, the largest memory
        results[layout] = (float(both[0]), float(both[1]))
    if rank == 0:
        base_t, base_m = results["ulysses"]
        what = "peak CUDA memory" if device.type == "cuda" else "saved activations"
        print(f"{args.family}, hidden {args.hidden}, {args.layers} layers, {heads} heads / 2 kv, {args.tokens} "
              f"tokens in {len(lengths)} sequences, {world} ranks ({backend})")
        for layout, (t, m) in results.items():
            print(f"  {layout:<8} step {t * 1e3:9.1f} ms ({t / base_t:5.2f}x)   {what} per rank "
                  f"{m / 2 ** 20:8.1f} MiB ({m / base_m:5.2f}x)")
    dist.barrier()
    if init is not None:
        sys.stdout.flush()
        os._exit(0)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="qwen2")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--nccl", action="store_true", help="under torchrun, one GPU per rank")
    args = p.parse_args()
    if args.nccl:
        dist.init_process_group("nccl")
        _worker(dist.get_rank(), dist.get_world_size(), None, args, "nccl")
        return
    folder = tempfile.mkdtemp(prefix="tfcompat-bench-")
    init = "file://" + os.path.join(folder, "rendezvous")
    mp.start_processes(_worker, args=(args.world, init, args, "gloo"), nprocs=args.world, start_method="spawn")


if __name__ == "__main__":
    main()
