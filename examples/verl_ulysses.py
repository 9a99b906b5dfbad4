# torchrun --nproc_per_node 2 examples/verl_ulysses.py   (verl's actor step: packed rows, Ulysses, checkpointing)
import copy
import inspect
import sys

import torch
import torch.distributed as dist

import tfcompat
from tfcompat.embeds import mm_token_type_ids, rope_index
from tfcompat.packing import pack, unpack
from tfcompat.testing import tiny_model, tiny_pixels, tiny_sequence
from tfcompat.ulysses import gather_from_ranks

dist.init_process_group("gloo")                 # verl: NCCL, its Ulysses group from the device mesh
group = dist.group.WORLD
model = tiny_model("qwen2_5_vl").train()        # yours: Qwen2_5_VLForConditionalGeneration.from_pretrained(...)
upstream = copy.deepcopy(model)                 # the unpatched model, for the comparison at the end
tfcompat.patch(model, ulysses_group=group, slice_inputs=True)  # every rank passes the whole row, as verl's VLM path
tfcompat.enable_checkpointing(model)            # transformers' own (non-reentrant), by this release's name

rows = [tiny_sequence("qwen2_5_vl", text=6, image=True), tiny_sequence("qwen2_5_vl", text=9)]
width = max(map(len, rows))
ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])           # the padded batch a collator gives
mask = (torch.arange(width) < torch.tensor([[len(r)] for r in rows])).long()
pixels = tiny_pixels(images=1)
pos, _ = rope_index(model.config, ids, attention_mask=mask, image_grid_thw=pixels["image_grid_thw"])
packed = pack(ids, mask, pos, config=model.config)                      # one row, (4, 1, total) position ids

def loss_of(logits):                            # next-token cross-entropy over the real tokens
    keep = mask[:, 1:].bool()
    return torch.nn.functional.cross_entropy(logits[:, :-1][keep].float(), ids[:, 1:][keep])

local = model(input_ids=packed.input_ids, position_ids=packed.position_ids, **pixels).logits  # this rank's slice
total = packed.input_ids.shape[1]           # the row is padded to a multiple of the group: drop that
loss = loss_of(unpack(gather_from_ranks(local, dim=1, group=group, length=total), packed))
loss.backward()                                 # each rank: its slice's share of every gradient
grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
for g in grads:
    dist.all_reduce(g)                          # summed over the group (FSDP/DDP: grad_scale="group")

types = {"mm_token_type_ids": mm_token_type_ids(upstream, ids)}  # what 5.3+ forwards need beside pixels
kw = types if "mm_token_type_ids" in inspect.signature(upstream.forward).parameters else {}
want = loss_of(upstream(input_ids=ids, attention_mask=mask, **pixels, **kw).logits)
want.backward()
diff = max((g - (p.grad if p.grad is not None else 0)).abs().max().item()
           for g, p in zip(grads, upstream.parameters()))
scale = max(p.grad.abs().max().item() for p in upstream.parameters() if p.grad is not None)
TOL = 1e-5                                      # relative: fp32 on the CPU lands near 1e-7
ok = abs(loss.item() - want.item()) <= TOL * abs(want.item()) and diff <= TOL * scale
print(f"rank {dist.get_rank()}/{dist.get_world_size()}: loss {loss.item():.6f} vs unpatched padded {want.item():.6f}, "
      f"max|grad diff| {diff:.1e} (largest grad {scale:.1e}): {'PASS' if ok else 'FAIL'}")
dist.destroy_process_group()
sys.exit(0 if ok else 1)
