"""Ulysses sequence parallelism on CPU with gloo: each rank holds half of a packed row.

    torchrun --nproc_per_node 2 examples/ulysses_cpu.py

The gathered logits equal the single-process packed run (printed on rank 0).
"""

import torch
import torch.distributed as dist

import tfcompat
from tfcompat.packing import pack
from tfcompat.testing import tiny_model, tiny_sequence
from tfcompat.ulysses import gather_from_ranks, slice_for_rank

dist.init_process_group("gloo")
family = "qwen2"
rows = [tiny_sequence(family, text=7), tiny_sequence(family, text=4)]
ids = torch.zeros(2, 7, dtype=torch.long)
mask = torch.zeros_like(ids)
for i, row in enumerate(rows):
    ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
packed = pack(ids, mask)

model = tiny_model(family)
tfcompat.patch(model, ulysses_group=dist.group.WORLD)
local = model(input_ids=slice_for_rank(packed.input_ids, dim=1),
              position_ids=slice_for_rank(packed.position_ids, dim=1)).logits
logits = gather_from_ranks(local, dim=1, length=packed.input_ids.shape[1])

reference = tiny_model(family)
tfcompat.patch(reference)
want = reference(input_ids=packed.input_ids, position_ids=packed.position_ids).logits
if dist.get_rank() == 0:
    print(f"ranks {dist.get_world_size()}: max |ulysses - single process| = {(logits - want).abs().max().item():.2e}")
dist.destroy_process_group()
