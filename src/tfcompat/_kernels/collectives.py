"""The collectives the sequence-parallel code is built on, written once: every rank's tensor gathered (the
forwards of Ulysses' gather, context parallelism's row and K/V gathers, and the checks' all-gathers of small
shape and fingerprint tensors)."""

import torch
import torch.distributed as dist


def all_gather(x, group):
    """Every rank's ``x`` (equal shapes on every rank), rank after rank, as a list."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return parts
