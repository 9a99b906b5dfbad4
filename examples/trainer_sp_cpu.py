"""Ulysses sequence parallelism under transformers.Trainer on CPU with gloo: 4 ranks, data parallel 2 x Ulysses 2
on one DeviceMesh, packed rows from DataCollatorWithFlattening.

    torchrun --nproc_per_node 4 examples/trainer_sp_cpu.py

It trains twice from the same weights on the same examples: plain data parallelism over the 4 ranks (the unpatched
model, padded micro-batches), then the sequence-parallel run. It prints both runs' per-step losses and the
largest difference of the final weights, PASS or FAIL, and exits 1 on a mismatch.
"""

import copy
import sys

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh

import tfcompat
from tfcompat.testing import tiny_model, tiny_sequence
from tfcompat.trainer import SequenceParallelMixin, checkpointing_args


class SPTrainer(SequenceParallelMixin, transformers.Trainer):
    pass


def padded(batch):
    """The plain run's collator: each micro-batch padded, no target at padding."""
    width = max(len(b["input_ids"]) for b in batch)
    ids = torch.tensor([b["input_ids"] + [0] * (width - len(b["input_ids"])) for b in batch])
    mask = (torch.arange(width) < torch.tensor([[len(b["input_ids"])] for b in batch])).long()
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 0] = -100                     # as the flattening collator: no target for a first token
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def train(trainer_cls, model, collator, folder):
    examples = [{"input_ids": tiny_sequence("qwen3", text=n)} for n in (5, 3, 7, 4, 6, 2, 8, 3) * 2]
    args = transformers.TrainingArguments(output_dir=folder, per_device_train_batch_size=2, max_steps=2,
                                          learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="no",
                                          disable_tqdm=True, logging_steps=1, average_tokens_across_devices=True,
                                          **checkpointing_args())
    trainer = trainer_cls(model=model, args=args, train_dataset=examples, data_collator=collator)
    trainer.train()
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]


dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "sp"))
model = tiny_model("qwen3")                 # yours: AutoModelForCausalLM.from_pretrained(...)
plain = copy.deepcopy(model)                # the same weights, unpatched: plain data parallelism
tfcompat.patch(model, ulysses_group=mesh["sp"].get_group(), slice_inputs=True)
want = train(transformers.Trainer, plain, padded, "/tmp/tfcompat-trainer-dp")
got = train(SPTrainer, model, transformers.DataCollatorWithFlattening(), "/tmp/tfcompat-trainer-sp")
apart = max(abs(a - b) for a, b in zip(got, want)) if len(got) == len(want) == 2 else float("inf")
weights = max((a - b).abs().max().item() for a, b in zip(model.parameters(), plain.parameters()))
TOL = 1e-4                                  # AdamW at lr 1e-3: a step moves a weight by about 1e-3
ok = apart <= TOL and weights <= TOL
if dist.get_rank() == 0:
    print(f"{dist.get_world_size()} ranks (dp x sp = {tuple(mesh.shape)}): losses {got} vs plain data parallel "
          f"{want}; max|loss diff| {apart:.1e}, max|weight diff| {weights:.1e}: {'PASS' if ok else 'FAIL'}")
dist.destroy_process_group()
sys.exit(0 if ok else 1)
