"""Spawned gloo ranks for the benchmarks: tfcompat.testing.spawn_ranks (the harness the tests and ``tfcompat check``
share), with rank 0's return value (JSON) coming back to the caller."""

import os

from tfcompat.testing import spawn_ranks


def run(fn, world, *args, trainer_env=False):
    """Rank 0's ``fn(rank, world, *args)`` over ``world`` spawned gloo ranks (torch threads shared among them);
    ``trainer_env``: the variables torchrun sets, which transformers.Trainer's accelerate reads."""
    outcomes = spawn_ranks(fn, world, *args, timeout=3600, threads=max(1, (os.cpu_count() or 2) // world),
                           launcher_env=trainer_env, init_timeout=900)
    errors = [f"rank {o['rank']}: {o['error']}" for o in outcomes if "error" in o]
    if errors:
        raise RuntimeError(f"the benchmark's ranks failed: {'; '.join(errors[:2])}")
    return outcomes[0]["result"]
