"""Sequence parallelism (Ulysses, context parallelism, or both) under ``transformers.Trainer`` and TRL's
``SFTTrainer``, through the Trainer's documented hooks (``training_step``, ``compute_loss``):

    model = AutoModelForCausalLM.from_pretrained(...)
    tfcompat.patch(model, ulysses_group=sp, context_group=cp, slice_inputs=True)

    class SPTrainer(SequenceParallelMixin, transformers.Trainer):   # or trl.SFTTrainer
        pass

    SPTrainer(model=model, args=args, train_dataset=..., data_collator=DataCollatorWithFlattening()).train()

The data plan is the Trainer's own: every rank draws its own micro-batch (one packed row) as under plain data
parallelism, so the schedule, the effective batch and ``num_items_in_batch`` are those of the same run without
sequence parallelism. In each training step the ranks of one sequence group (the ranks that share a row: the
Ulysses group times the context group) exchange their rows, and every rank runs forward and backward on its share
of each of them in turn (the whole-row call: ``slice_inputs=True``), the loss of each share normalised as the
Trainer normalises the owner's loss (by the owner's ``num_items_in_batch``, or the mean over the owner's row when the
model takes no loss kwargs, times the processes when tokens are averaged across devices). DDP or FSDP over all
ranks then averages the gradients exactly as it does for data parallelism: the per-step losses and parameters are
those of the run without sequence parallelism (tests/test_trainer_sp.py: 4 gloo ranks against the single-process
padded Trainer). Activation memory per rank is that of one share of one row.

Refused (:class:`~tfcompat.errors.UlyssesError`, before any step): a model patched without a group or without
``slice_inputs=True``; batches of several rows (pack them: ``DataCollatorWithFlattening`` or TRL's
``padding_free=True``); label smoothing, ``compute_loss_func``, TRL losses other than ``nll``, Liger kernels,
DeepSpeed's engine and accelerate's own ``sp``/``cp`` dimensions (each would compute another loss or split the row
again); evaluation and prediction (each rank would return a share of another rank's row).

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
import torch.distributed as dist

from .errors import UlyssesError
from .ulysses import slice_for_rank

__all__ = ["SequenceParallelMixin", "sequence_groups", "checkpointing_args"]

_WHAT = f"{__name__}.SequenceParallelMixin"  # the vendored copy names itself


def checkpointing_args(*, reentrant: bool = False) -> dict:
    """``TrainingArguments`` keywords that turn on activation checkpointing on the installed release, by its own
    name: ``activation_checkpointing`` (5.24+; the old name warns there) or ``gradient_checkpointing``, with
    ``use_reentrant`` set (non-reentrant by default, as 5.x defaults)::

        args = transformers.TrainingArguments(output_dir=..., **checkpointing_args())

    .. versionadded:: 0.2.0
    """
    import dataclasses

    import transformers

    names = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    key = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    return {key: True, f"{key}_kwargs": {"use_reentrant": bool(reentrant)}}


def sequence_groups(model: Any) -> dict:
    """The sequence groups ``model`` was patched with, as keyword arguments for :mod:`tfcompat.ulysses`
    (``{"group": ..., "context_group": ...}``, either or both), read through DDP / FSDP / PEFT wrappers.

    Raises:
        UlyssesError: the model was not patched with a group, or not with ``slice_inputs=True``.
    """
    from ._step.install import _patched_as

    for module in model.modules():
        state = _patched_as(module)
        if state is None or state.kind != "text":
            continue
        state.group_or_raise()
        split = state.split()
        if not split:
            break
        if not state.slice_inputs:
            raise UlyssesError(f"{_WHAT}: the model is patched for sequence parallelism without slice_inputs=True; "
                               f"the Trainer hands every rank of a group the whole row: patch with "
                               f"tfcompat.patch(model, ulysses_group=..., context_group=..., slice_inputs=True)")
        return split
    raise UlyssesError(f"{_WHAT}: {type(model).__name__} is not patched for sequence parallelism; call "
                       f"tfcompat.patch(model, ulysses_group=sp, context_group=cp, slice_inputs=True) (either group or "
                       f"both) before building the Trainer, or train with the plain Trainer")


def _refusals(trainer) -> Optional[str]:
    """Why this Trainer's settings cannot run the exact sequence-parallel step (None: they can)."""
    args = trainer.args
    pc = getattr(getattr(trainer, "accelerator", None), "parallelism_config", None)
    if pc is not None and (getattr(pc, "sp_enabled", False) or getattr(pc, "cp_enabled", False)
                           or getattr(pc, "tp_enabled", False)):
        return ("the TrainingArguments carry a ParallelismConfig with sp, cp or tp: accelerate would split the row "
                "(or the weights) again; leave those dimensions at 1 (tfcompat's groups do the sequence split)")
    if getattr(trainer, "is_deepspeed_enabled", False):
        return "DeepSpeed's engine counts micro-steps itself; train with DDP or FSDP"
    if getattr(trainer, "label_smoother", None) is not None:
        return "label_smoothing_factor is set; the share's loss is the plain cross entropy"
    if getattr(trainer, "compute_loss_func", None) is not None:
        return "a compute_loss_func is set; it would see a share of the logits and the whole row's labels"
    if getattr(args, "loss_type", None) not in (None, "nll"):
        return f"TRL's loss_type={args.loss_type!r}; only the plain cross entropy ('nll') is computed on shares"
    if getattr(args, "use_liger_kernel", False):
        return "use_liger_kernel=True fuses the loss with the head over the whole row"
    if getattr(args, "n_gpu", 1) > 1:
        return "torch.nn.DataParallel (n_gpu > 1); launch one process per device"
    return None


class SequenceParallelMixin:
    """Mix into ``transformers.Trainer`` or ``trl.SFTTrainer`` (listed first among the bases) to train a model
    patched with ``ulysses_group`` and/or ``context_group`` and ``slice_inputs=True``: see the module's text.

    .. versionadded:: 0.2.0
    """

    def training_step(self, model, inputs, num_items_in_batch=None, *args, **kwargs):
        split = sequence_groups(model)
        why = _refusals(self)
        if why:
            raise UlyssesError(f"{_WHAT}: {why}")
        rows = _group_rows(dict(inputs), num_items_in_batch, split, self.args.device)
        shares = []
        for i, (row, items) in enumerate(rows):
            last = i == len(rows) - 1  # DDP synchronises the gradients once, after the group's last row
            sync = contextlib.nullcontext() if last else self.accelerator.no_sync(model)
            self._tfcompat_split = split
            try:
                with sync:
                    shares.append(super().training_step(model, row, items, *args, **kwargs))
            finally:
                self._tfcompat_split = None
        return _own_loss(shares, split)

    def prediction_step(self, model, inputs, *args, **kwargs):
        # evaluation and predict(): each rank would return its share of the logits of its own row
        sequence_groups(model)
        raise UlyssesError(f"{_WHAT}: evaluation and prediction under sequence parallelism are not built (each rank "
                           f"would return a share of another rank's row); set eval_strategy='no' and evaluate with a "
                           f"model patched without groups")

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None, **kwargs):
        split = getattr(self, "_tfcompat_split", None)
        if split is None:
            raise UlyssesError(f"{_WHAT}: compute_loss runs inside its training_step (which gives every rank of the "
                               f"group the same row); a loss outside a training step is not built under sequence "
                               f"parallelism")
        inputs = dict(inputs)
        labels, shift = inputs.pop("labels", None), inputs.pop("shift_labels", None)
        if shift is None:
            if labels is None:
                raise UlyssesError(f"{_WHAT}: the batch has no labels; the collator must return labels (or "
                                   f"shift_labels) for the loss")
            shift = torch.nn.functional.pad(labels[..., 1:], (0, 1), value=-100)  # the whole row's targets
        inputs["use_cache"] = False
        outputs = model(**inputs)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        mine = slice_for_rank(shift.to(logits.device), dim=1, pad_value=-100, **split)
        if mine.shape != logits.shape[:-1]:
            raise UlyssesError(f"{_WHAT}: the model returned logits of shape {tuple(logits.shape)} for a share of "
                               f"labels {tuple(mine.shape)}; is the model patched with slice_inputs=True?")
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), mine.reshape(-1),
                                                 ignore_index=-100, reduction="sum")
        normalised = bool(self.model_accepts_loss_kwargs) and num_items_in_batch is not None
        # the owner's loss as upstream computes it: over num_items_in_batch, or the mean over its row
        if not normalised:
            loss = loss / shift.ne(-100).sum().to(loss.device)
        else:
            loss = loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch)
                           else num_items_in_batch)
        if normalised and getattr(self.args, "average_tokens_across_devices", False):
            loss = loss * self.accelerator.num_processes  # as Trainer.compute_loss scales it
        return (loss, outputs) if return_outputs else loss


def _own_loss(shares, split):
    """What this rank logs: the loss of its own row (the sum of every rank's share of it), as the run without
    sequence parallelism logs it. The Trainer drops a NaN step loss rank by rank (``logging_nan_inf_filter``): a
    row without targets (NaN where ``num_items_in_batch`` is its own, 0) is then dropped on its owner only. The
    rows are those of :func:`_group_rows`, the same on every rank of the group: row ``c * U + u`` is the row of
    context rank c, Ulysses rank u; a sum over both groups adds every rank's share of each."""
    losses = torch.stack([loss.detach().reshape(()) for loss in shares])
    own, width = 0, 1
    for key in ("group", "context_group"):  # Ulysses varies fastest: _group_rows' inner exchange
        group = split.get(key)
        if group is not None:
            dist.all_reduce(losses, group=group)
            own += dist.get_group_rank(group, dist.get_rank()) * width
            width *= dist.get_world_size(group)
    return losses[own].to(shares[0].dtype)


def _check_row(inputs):
    ids = inputs.get("input_ids")
    if not torch.is_tensor(ids) or ids.dim() != 2 or ids.shape[0] != 1:
        shape = tuple(ids.shape) if torch.is_tensor(ids) else type(ids).__name__
        raise UlyssesError(f"{_WHAT}: the collator returned input_ids of shape {shape}; sequence parallelism "
                           f"splits one packed row: collate with transformers.DataCollatorWithFlattening (or TRL's "
                           f"padding_free=True), whose rows carry position_ids")
    mask = inputs.get("attention_mask")
    if torch.is_tensor(mask) and not bool(mask.all()):
        raise UlyssesError(f"{_WHAT}: the packed row has padding (attention_mask has zeros); a packed row holds "
                           f"only tokens")


def _group_rows(inputs, items, split, device):
    """[(row, num_items_in_batch)] of every rank of this rank's sequence group (the context group's rows, then
    each of those over the Ulysses group: the same order on every rank of the group)."""
    _check_row(inputs)
    rows = [(inputs, items)]
    for key in ("context_group", "group"):
        if split.get(key) is not None:
            rows = [got for row in rows for got in _exchange(row, split[key], device)]
    return rows


def _meta(row, items):
    tensors, values = {}, {}
    for k, v in row.items():
        if torch.is_tensor(v):
            tensors[k] = (tuple(v.shape), v.dtype)
        else:
            values[k] = v
    if torch.is_tensor(items):
        items = ("tensor", items.item(), items.dtype)
    return tensors, values, items


def _exchange(mine, group, device):
    """Every rank's (row, items) of ``group``, in group-rank order: a small object per rank (keys, shapes,
    dtypes, the item count), then each tensor broadcast from its owner."""
    row, items = mine
    me = dist.get_rank()
    out = []
    for src in dist.get_process_group_ranks(group):
        obj = [_meta(row, items) if src == me else None]
        dist.broadcast_object_list(obj, src=src, group=group)
        tensors, values, n = obj[0]
        got = dict(values)
        for k, (shape, dtype) in tensors.items():
            buf = row[k].to(device).contiguous() if src == me else torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(buf, src=src, group=group)
            got[k] = buf
        if isinstance(n, tuple) and n and n[0] == "tensor":
            n = torch.tensor(n[1], dtype=n[2], device=device)
        out.append((got, n))
    return out
