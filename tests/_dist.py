"""Spawned-process helpers: file rendezvous in a temporary folder (no TCP port), hard timeout."""

import datetime
import os
import sys
import tempfile
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, fn, world, init, args):
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    fn(rank, world, *args)
    dist.barrier()  # nobody leaves while a peer still reads its last message
    # gloo's transport threads can abort the interpreter's teardown ("terminate called without
    # an active exception"); the work is done and checked, so leave without tearing down
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, world, *args, timeout=300):
    folder = tempfile.mkdtemp(prefix="tfcompat-dist-")
    init = "file://" + os.path.join(folder, "rendezvous")
    ctx = mp.start_processes(_entry, args=(fn, world, init, args), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"spawned test did not finish in {timeout}s (hang?)")
