"""Spawned gloo ranks for the benchmarks: a file rendezvous in a temporary folder (no port), every rank runs
``fn(rank, world, *args)`` and rank 0's return value (JSON) comes back to the caller."""

import datetime
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, world, init, folder, fn, args, trainer_env):
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    if trainer_env:  # what accelerate (under transformers.Trainer) reads to find the process group it joins
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT="29556")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=900))
    out = fn(rank, world, *args)
    if rank == 0:
        with open(os.path.join(folder, "out.json"), "w") as f:
            json.dump(out, f)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads can abort the interpreter's teardown; the result is written


def run(fn, world, *args, trainer_env=False):
    """Rank 0's ``fn(rank, world, *args)`` over ``world`` spawned gloo ranks."""
    folder = tempfile.mkdtemp(prefix="tfcompat-bench-")
    mp.start_processes(_entry, args=(world, "file://" + os.path.join(folder, "rendezvous"), folder, fn, args,
                                     trainer_env), nprocs=world, start_method="spawn")
    with open(os.path.join(folder, "out.json")) as f:
        return json.load(f)
