"""transformers.Trainer with tfcompat's sequence parallelism (tfcompat.trainer.SequenceParallelMixin) beside the same
Trainer run as plain data parallelism, same model, same packed micro-batches, in one run: the activations one
forward saves for backward on a rank (the largest over the steps) and the step time (the slowest rank's median),
as ratios to data parallelism.

    python bench/trainer_sp.py                      # 4 gloo ranks on the CPU
    python bench/trainer_sp.py --tokens 8192 --hidden 512

Layouts over 4 ranks: "dp4" (data parallelism: every rank its own rows, whole), "dp2 x sp2" (Ulysses 2 on one
DeviceMesh), "sp4" (Ulysses over all 4), "cp4" (context parallelism over all 4). A sequence-parallel rank runs
each row of its group in turn, a share at a time: the same tokens per rank as data parallelism, the activations
of one share. Activations: the bytes of the tensors autograd saves in one forward (``saved_tensors_hooks``);
on a GPU, peak memory would say the same. tests/test_trainer_sp.py proves the numbers equal; this measures cost.
"""

import argparse
import statistics
import tempfile
import time

import _ranks  # bench/_ranks.py: the folder of the script run is on sys.path
import torch
import torch.distributed as dist

LAYOUTS = ("dp4", "dp2 x sp2", "sp4", "cp4")


def _groups(layout):
    if layout == "dp2 x sp2":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
        return {"ulysses_group": mesh["sp"].get_group()}
    return {"sp4": {"ulysses_group": dist.group.WORLD}, "cp4": {"context_group": dist.group.WORLD}}.get(layout)


def _trainer_class(sp):
    import transformers

    from tfcompat.trainer import SequenceParallelMixin

    class Measured(*((SequenceParallelMixin,) if sp else ()), transformers.Trainer):
        saved = 0

        def compute_loss(self, *args, **kwargs):
            box = [0]

            def pack_hook(t):
                box[0] += t.numel() * t.element_size()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
                out = super().compute_loss(*args, **kwargs)
            self.saved = max(self.saved, box[0])
            return out

    return Measured


def _run(layout, args, world):
    import transformers

    import tfcompat
    from tfcompat.testing import tiny_model

    torch.manual_seed(0)
    model = tiny_model("qwen3", hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                       num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
                       head_dim=args.hidden // 8)
    groups = _groups(layout)
    if groups:
        tfcompat.patch(model, slice_inputs=True, **groups)
    else:
        tfcompat.patch(model)
    g = torch.Generator().manual_seed(1)
    share = args.tokens // 4  # 4 sequences per micro-batch of about --tokens tokens
    examples = [{"input_ids": torch.randint(3, 240, (share + int(torch.randint(-9, 9, (1,), generator=g)),),
                                            generator=g).tolist()} for _ in range(4 * world * (args.steps + 1))]
    times, losses = [], []

    class Clock(transformers.TrainerCallback):
        def on_log(self, *a, logs=None, **k):
            if logs and "loss" in logs:
                losses.append(logs["loss"])  # the mean over the ranks
        def on_step_begin(self, *a, **k):
            dist.barrier()
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.start)

    targs = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, max_steps=args.steps + 1, learning_rate=1e-4,
        report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, logging_steps=1,
        gradient_checkpointing=args.checkpointing, average_tokens_across_devices=True)
    trainer = _trainer_class(bool(groups))(model=model, args=targs, train_dataset=examples, callbacks=[Clock()],
                                           data_collator=transformers.DataCollatorWithFlattening())
    trainer.train()
    slowest = torch.tensor([statistics.median(times[1:]), float(trainer.saved)])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist() + [losses]


def _worker(rank, world, args):
    return {layout: _run(layout, args, world) for layout in LAYOUTS}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of each rank's packed micro-batch")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing on")
    args = parser.parse_args()
    world = 4
    out = _ranks.run(_worker, world, args, trainer_env=True)
    print(f"{world} gloo ranks, transformers.Trainer, Qwen3 8/2 heads hidden {args.hidden} x {args.layers} layers, "
          f"~{args.tokens} tokens per rank's micro-batch (4 sequences), fp32, checkpointing "
          f"{'on' if args.checkpointing else 'off'}; step: median of {args.steps}, slowest rank")
    base_time, base_saved, base_losses = out["dp4"]
    for layout, (t, saved, losses) in out.items():
        apart = max(abs(a - b) for a, b in zip(losses, base_losses))
        print(f"  {layout:<10} step {t * 1e3:8.1f} ms ({t / base_time:5.2f}x)   saved activations per forward "
              f"{saved / 2**20:8.1f} MiB ({saved / base_saved:5.2f}x)   losses {apart:.1e} from dp4's")


if __name__ == "__main__":
    main()
