"""A packed, checkpointed training step of a vision-language model on CPU, in seconds.

    python examples/vl_training_step.py [family]      # default qwen2_vl; a VL family tfcompat.patch serves

Swap the tiny model for ``from_pretrained(...)`` and the tiny batch for your collator's output. It compares the loss
and every gradient with the unpatched model on the padded batch, prints PASS or FAIL, and exits 1 on a mismatch.
"""

import copy
import inspect
import sys

import torch

import tfcompat
import tfcompat.errors
from tfcompat.embeds import mm_token_type_ids, rope_index
from tfcompat.packing import pack, unpack
from tfcompat.testing import tiny_model, tiny_pixels, tiny_sequence

family = sys.argv[1] if len(sys.argv) > 1 else "qwen2_vl"
try:
    model = tiny_model(family).train()
except tfcompat.errors.TfcompatError as exc:  # a family this release does not ship, or an unknown name
    sys.exit(f"vl_training_step: {exc}")
if getattr(model.config, "vision_config", None) is None:
    sys.exit(f"vl_training_step: {family} is a text-only family; this example trains a vision-language model "
             f"(qwen2_vl, qwen2_5_vl, glm4v, qwen3_vl, ...)")
upstream = copy.deepcopy(model)                # the unpatched model, for the comparison below
tfcompat.enable_checkpointing(model)           # transformers' own, by whichever name this release has
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

# a padded batch as a collator returns it: one sample with an image, one text-only
rows = [tiny_sequence(family, text=6, image=True), tiny_sequence(family, text=4)]
ids = torch.zeros(2, max(map(len, rows)), dtype=torch.long)
mask = torch.zeros_like(ids)
for i, row in enumerate(rows):
    ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
pixels = tiny_pixels(images=1)

try:
    tfcompat.patch(model)                                               # 1. once, after loading
except tfcompat.errors.TfcompatError as exc:  # a family whose attention tfcompat refuses, with the reason
    sys.exit(f"vl_training_step: {exc}")
pos, _ = rope_index(model.config, ids, attention_mask=mask,             # 2. in the dataloader worker:
                    image_grid_thw=pixels["image_grid_thw"])            #    needs only the config
packed = pack(ids, mask, pos, config=model.config)                      # 3. one row, 4-row position ids
logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids, **pixels).logits  # 4.
labels = torch.where(mask.bool(), ids, -100)
loss = torch.nn.functional.cross_entropy(unpack(logits, packed)[:, :-1].flatten(0, 1).float(),
                                         labels[:, 1:].flatten(), ignore_index=-100)
loss.backward()                                                         # 5.

# the same step on the unpatched model and the padded batch (5.3+ forwards need the token types beside pixels)
kw = {"mm_token_type_ids": mm_token_type_ids(upstream, ids)} \
    if "mm_token_type_ids" in inspect.signature(upstream.forward).parameters else {}
want = torch.nn.functional.cross_entropy(upstream(input_ids=ids, attention_mask=mask, **pixels, **kw).logits[:, :-1]
                                         .flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
want.backward()
scale = max(p.grad.abs().max().item() for p in upstream.parameters() if p.grad is not None)
diff = max((a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), upstream.parameters())
           if b.grad is not None)
TOL = 1e-5  # relative: fp32 on the CPU lands near 1e-7
ok = abs(loss.item() - want.item()) <= TOL * abs(want.item()) and diff <= TOL * scale
print(f"{family}: packed {packed.input_ids.shape[1]} tokens of {tuple(ids.shape)}: loss {loss.item():.6f} vs "
      f"unpatched padded {want.item():.6f}, max|grad diff| {diff:.1e} (largest grad {scale:.1e}): "
      f"{'PASS' if ok else 'FAIL'}")
if not ok:
    sys.exit(1)
opt.step()

# a text-only micro-batch (some ranks get one): the patched model still runs the vision tower on a
# dummy input, so every vision weight gets a zero gradient and DDP/FSDP ranks stay in step
opt.zero_grad()
text_ids = torch.tensor([tiny_sequence(family, text=5)])
model(input_ids=text_ids).logits.float().pow(2).mean().backward()
missing = [n for n, p in model.named_parameters() if "visual" in n and p.grad is None]
print(f"text-only batch: every vision weight has a gradient: {'FAIL' if missing else 'PASS'}")
sys.exit(1 if missing else 0)
