"""Spawned-process helpers: file rendezvous in a temporary folder (no TCP port), hard timeouts.

``run_scenarios`` spawns the workers once and runs many cases in them (spawning costs seconds per
process: importing torch and transformers), each case's outcome recorded per rank.
"""

import os
import sys
import time
import traceback

import pytest
import torch
import torch.distributed as dist


def _start_method(fn):
    """"forkserver" with torch, transformers, tfcompat and the test module imported once in the server (each
    worker forks from it instead of importing them again: seconds per worker), where the platform has it;
    else "spawn". Nothing has touched CUDA or started threads in the server when it forks."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    # transformers.modeling_utils: what every modeling module imports first (generation, weight loading,
    # torch.distributed.tensor: seconds), then the modeling modules of the families the test module names
    families = getattr(sys.modules.get(fn.__module__), "PRELOAD_FAMILIES", ())
    from tfcompat._probe.families import FAMILIES

    modeling = [FAMILIES[n].modeling for n in families if n in FAMILIES]
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.fsdp", "transformers",
                                            "transformers.modeling_utils",
                                            *modeling, "tfcompat", "tfcompat.testing", "_dist", fn.__module__])
    return "forkserver"


def spawn(fn, world, *args, timeout=300, collect=False):
    """``fn(rank, world, *args)`` over ``world`` gloo ranks (tfcompat.testing.spawn_ranks, the one harness the
    tests, the benchmarks and ``tfcompat check`` share); a rank that fails, dies or runs past ``timeout`` fails
    the test. ``collect``: every rank's return value, in rank order."""
    from tfcompat.testing import spawn_ranks

    outcomes = spawn_ranks(fn, world, *args, timeout=timeout, start_method=_start_method(fn))
    errors = [f"rank {o['rank']}: {o['error']}" for o in outcomes if "error" in o]
    if errors:
        pytest.fail(f"spawned ranks failed: {'; '.join(errors[:2])}")
    return [o["result"] or {} for o in outcomes] if collect else None


def run_cases(rank, cases):
    """Run ``(name, fn)`` cases in order on this rank; record "ok" or the traceback of each.

    A barrier after each case keeps the ranks in step; a case that fails on one rank while a peer waits
    in a collective ends by the process group's timeout, not a hang.
    """
    results = {}
    verbose = os.environ.get("TFCOMPAT_TEST_VERBOSE")
    for name, fn in cases:
        began = time.monotonic()
        try:
            fn()
            results[name] = "ok"
        except Exception:  # recorded and asserted by the test of that case
            results[name] = traceback.format_exc()[-3000:]
        try:
            dist.barrier()
        except Exception:
            results[name] += "\n(barrier after the case failed)"
            break
        if verbose:
            print(f"[rank {rank}] {name}: {time.monotonic() - began:.1f}s", file=sys.stderr, flush=True)
    return results


def merged(per_rank):
    """case -> "ok" if every rank says ok, else the first rank's failure."""
    out = {}
    for rank, results in enumerate(per_rank):
        for name, value in results.items():
            if value != "ok" and out.get(name, "ok") == "ok":
                out[name] = f"rank {rank}: {value}"
            out.setdefault(name, value)
    return out


#: torch's own limits on CPU, not tfcompat's: FSDP2 on CPU needs streams with record_event (torch 2.7+),
#: and until torch 2.8 its fp32 reduce-scatter asks the process group for ReduceOp.AVG, which gloo lacks
#: (NCCL has it). The lowest-torch environment meets them; a case stopped by one is skipped by name.
TORCH_CPU_LIMITS = ("'Stream' object has no attribute 'record_event'", "Cannot use ReduceOp.AVG with Gloo")


def assert_ok(outcomes, case):
    """The case ran and passed on every rank (or met one of torch's CPU limits above: skipped, saying which)."""
    assert case in outcomes, f"case {case} did not run: {sorted(outcomes)}"
    limit = next((m for m in TORCH_CPU_LIMITS if m in outcomes[case]), None)
    if limit is not None:
        pytest.skip(f"torch {torch.__version__} cannot run FSDP2 on CPU with gloo ({limit}); NCCL runs it")
    assert outcomes[case] == "ok", outcomes[case]


def sequence_groups(how):
    """The sequence groups of a layout over the 4 ranks: (patch kwargs, slice/gather kwargs) for "ulysses",
    "context", or "2x2" (context over "cp" x Ulysses over "sp" of one DeviceMesh)."""
    if how == "2x2":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "sp"))
        sp, cp = mesh["sp"].get_group(), mesh["cp"].get_group()
        return dict(ulysses_group=sp, context_group=cp), dict(group=sp, context_group=cp)
    if how == "ulysses":
        return dict(ulysses_group=dist.group.WORLD), dict(group=dist.group.WORLD)
    return dict(context_group=dist.group.WORLD), dict(context_group=dist.group.WORLD)
