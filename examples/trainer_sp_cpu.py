"""Ulysses sequence parallelism under transformers.Trainer on CPU with gloo: 4 ranks, data parallel 2 x Ulysses 2
on one DeviceMesh, packed rows from DataCollatorWithFlattening.

    torchrun --nproc_per_node 4 examples/trainer_sp_cpu.py

Rank 0 prints the per-step losses: those of the run without sequence parallelism (tests/test_trainer_sp.py
compares them, and the final weights, with the single-process Trainer on the same micro-batches).
"""

import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh

import tfcompat
from tfcompat.testing import tiny_model, tiny_sequence
from tfcompat.trainer import SequenceParallelMixin


class SPTrainer(SequenceParallelMixin, transformers.Trainer):
    pass


class Record(transformers.TrainerCallback):
    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(round(logs["loss"], 4))


def train(trainer_cls, model, folder):
    examples = [{"input_ids": tiny_sequence("qwen3", text=n)} for n in (5, 3, 7, 4, 6, 2, 8, 3) * 2]
    args = transformers.TrainingArguments(output_dir=folder, per_device_train_batch_size=2, max_steps=2,
                                          learning_rate=1e-3, gradient_checkpointing=True, report_to=[], use_cpu=True,
                                          save_strategy="no", disable_tqdm=True, logging_steps=1,
                                          average_tokens_across_devices=True)
    record = Record()
    trainer_cls(model=model, args=args, train_dataset=examples, callbacks=[record],
                data_collator=transformers.DataCollatorWithFlattening()).train()
    return record.losses


dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "sp"))
model = tiny_model("qwen3")                 # yours: AutoModelForCausalLM.from_pretrained(...)
tfcompat.patch(model, ulysses_group=mesh["sp"].get_group(), slice_inputs=True)
losses = train(SPTrainer, model, "/tmp/tfcompat-trainer-sp")
if dist.get_rank() == 0:
    print(f"{dist.get_world_size()} ranks (dp x sp = {mesh.shape}): losses {losses}")
dist.destroy_process_group()
