"""Sequence parallelism under transformers.Trainer and TRL's SFTTrainer (tfcompat.trainer.SequenceParallelMixin)
over 4 spawned gloo ranks: the per-step losses and the final parameters equal the single-process Trainer on the
padded batches of the same examples (every rank draws its own micro-batch; the global batch is 4 of them).

Layouts: Ulysses 2 x data parallel 2 on one DeviceMesh (a text family under DDP, with gradient accumulation, and
under the Trainer's FSDP2 (5.x: 4.x's Trainer builds an FSDP plugin that wants an accelerator); a VL family),
context parallelism over all 4 ranks on a model with fewer kv heads than ranks, context 2 x Ulysses 2 (a VL
family: each row over all 4 ranks), and TRL's SFTTrainer(padding_free=True) on the 2 x 2 mesh.
"""

import functools
import os

import pytest
import torch

import tfcompat
from tfcompat.embeds import rope_index
from tfcompat.packing import pack
from tfcompat.testing import families

from _dist import assert_ok, merged, run_cases, spawn
from _helpers import SPAWNED_RANKS_SKIPPED, patchable
from _models import forward_kwargs, padded, tiny_model, tiny_pixels, tiny_sequence, word_tokenizer

SPECS = families(installed_only=False)  # the family facts, from the public face


pytestmark = pytest.mark.xdist_group("distributed")

if SPAWNED_RANKS_SKIPPED:
    pytest.skip("the Trainer's sequence parallelism over spawned ranks runs on the boundary releases of the matrix "
                "(tox.ini says which)", allow_module_level=True)
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (installed by the tox envs)")

HAVE = patchable()
TEXT = next(n for n in ("qwen3", "qwen2") if n in HAVE)
FEW_KV = next(n for n in ("qwen2", "qwen3") if n in HAVE)
VL = next((n for n in ("qwen2_5_vl", "qwen2_vl") if n in HAVE), None)
PRELOAD_FAMILIES = sorted({TEXT, FEW_KV} | ({VL} if VL else set()))
WORLD, PER_RANK, STEPS, LR = 4, 2, 2, 1e-3
LENGTHS = [5, 3, 7, 4, 6, 2, 8, 3, 4, 5, 7, 2, 3, 6, 5, 4]  # WORLD * PER_RANK * STEPS examples


def _examples(name, vision=False):
    """VL: every other example has an image (rows with and without images in a group, text-only rows on some
    ranks: the patched model's dummy visual forward keeps DDP's vision gradients there)."""
    out = []
    for i, k in enumerate(LENGTHS):
        image = vision and i % 2 == 0
        ex = {"input_ids": tiny_sequence(name, text=k, image=image)}
        if image:
            ex.update(tiny_pixels(1, seed=i))
        out.append(ex)
    return out


def _labels(ids, mask):
    labels = torch.where(mask.bool(), ids, -100)
    labels[:, 0] = -100  # no position predicts a sequence's first token (as the flattening collators mask it)
    return labels


class _PaddedCollator:
    """The reference batches: right-padded rows (pixels and grids concatenated for a VL family)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, features):
        ids, mask = padded([f["input_ids"] for f in features])
        out = {"input_ids": ids, "attention_mask": mask, "labels": _labels(ids, mask)}
        with_image = [f for f in features if "pixel_values" in f]
        if with_image:
            out["pixel_values"] = torch.cat([f["pixel_values"] for f in with_image])
            out["image_grid_thw"] = torch.cat([f["image_grid_thw"] for f in with_image])
            out.update(forward_kwargs(self.model, ids))
        return out


class _PackedVLCollator(_PaddedCollator):
    """One packed row of a VL batch: its 3-D positions from the family's own get_rope_index, per sequence."""

    def __call__(self, features):
        padded_batch = super().__call__(features)
        ids, mask = padded_batch["input_ids"], padded_batch["attention_mask"]
        grid = padded_batch.get("image_grid_thw")
        pk = pack(ids, mask, rope_index(self.model, ids, image_grid_thw=grid, attention_mask=mask)[0], vision=True)
        out = {"input_ids": pk.input_ids, "position_ids": pk.position_ids,
               "labels": padded_batch["labels"][mask.bool()][None]}
        if grid is not None:
            out.update(pixel_values=padded_batch["pixel_values"], image_grid_thw=grid)
            out.update(forward_kwargs(self.model, pk.input_ids))
        return out


#: cases that accumulate gradients: micro-batches of PER_RANK / k examples, k per step on every rank
ACCUMULATE = {"ulysses_dp2_accumulate2": 2}


def _batching(case, processes):
    """The micro-batch size and accumulation of a case run over ``processes`` processes (1: the reference, which
    accumulates every rank's micro-batches)."""
    k = ACCUMULATE.get(case, 1)
    # the accumulating case also runs without activation checkpointing (DDP then looks for unused parameters)
    out = dict(per_device_train_batch_size=PER_RANK // k, gradient_accumulation_steps=k * WORLD // processes,
               gradient_checkpointing=k == 1)
    if case.startswith("lora"):
        # frozen embeddings: reentrant checkpointing (4.x's default) would leave the loss without a gradient, with
        # or without tfcompat; PEFT's users pass this
        out["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    return out


def _args(folder, trl=None, **extra):
    kw = dict(output_dir=folder, max_steps=STEPS, learning_rate=LR,
              logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
              disable_tqdm=True, average_tokens_across_devices=True)
    kw.update(extra)
    if trl is not None:
        return trl.SFTConfig(padding_free=kw.pop("padding_free", False), max_length=None, bf16=False, **kw)
    import transformers

    return transformers.TrainingArguments(**kw)


def _train(trainer_cls, model, args, dataset, collator=None, **extra):
    import transformers

    losses = []

    class Record(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    kw = dict(data_collator=collator) if collator is not None else {}
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset, callbacks=[Record()], **kw, **extra)
    trainer.train()
    params = {}
    for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters():
        # FSDP2 holds a shard per rank (a DTensor): the whole tensor (a collective every rank runs)
        params[n] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return losses, params


def _sp_trainer(base):
    from tfcompat.trainer import SequenceParallelMixin

    return type(f"SP{base.__name__}", (SequenceParallelMixin, base), {})


def _groups(layout):
    import torch.distributed as dist

    if layout == "context4":
        return dict(context_group=dist.group.WORLD)
    from torch.distributed.device_mesh import init_device_mesh

    if layout == "cp2xsp2":  # one row over all 4 ranks: context 2 x Ulysses 2
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "sp"))
        return dict(ulysses_group=mesh["sp"].get_group(), context_group=mesh["cp"].get_group())
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    return dict(ulysses_group=mesh["sp"].get_group())


def _trainer_env(rank):
    """What accelerate (under transformers.Trainer) reads to find the process group this rank already joined."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")


def _worker_case(rank, folder, case, name, layout, client):
    import transformers

    _trainer_env(rank)
    model = _model(case, name)
    tfcompat.patch(model, slice_inputs=True, **_groups(layout))
    out = os.path.join(folder, case)
    if client == "sft":
        import trl

        args = _args(out, trl=trl, padding_free=True, **_batching(case, WORLD))
        losses, params = _train(_sp_trainer(trl.SFTTrainer), model, args, _sft_dataset(name),
                                processing_class=word_tokenizer())
    else:
        vision = SPECS[name].vision
        collator = _PackedVLCollator(model) if vision else transformers.DataCollatorWithFlattening()
        args = _args(out, **_batching(case, WORLD), **(_fsdp2(model) if case.startswith("fsdp2") else {}))
        try:
            losses, params = _train(_sp_trainer(transformers.Trainer), model, args, _examples(name, vision), collator)
        finally:  # TrainingArguments(fsdp=...) exports the Trainer's FSDP settings for accelerate
            for key in [k for k in os.environ if k.startswith(("ACCELERATE_USE_FSDP", "FSDP_"))]:
                del os.environ[key]
    if rank == 0:
        torch.save({"losses": losses, "params": params}, os.path.join(folder, f"{case}.pt"))


def _model(case, name):
    """The tiny model; for a LoRA case, wrapped by PEFT (the adapters seeded: the same on every rank)."""
    model = tiny_model(name)
    if not case.startswith("lora"):
        return model
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))


def _fsdp2(model):
    """The Trainer's FSDP2 (through accelerate) over all ranks, one unit per decoder layer."""
    layer = type(next(m for m in model.modules() if type(m).__name__.endswith("DecoderLayer"))).__name__
    return dict(fsdp="full_shard", fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": [layer]})


def _sft_dataset(name):
    import datasets

    return datasets.Dataset.from_list([dict(e, labels=[-100] + e["input_ids"][1:]) for e in _examples(name)])


def _have_trl():
    try:
        import trl  # noqa: F401
    except ImportError:
        return False
    return True


CASES = [("ulysses_dp2", TEXT, "dp2xsp2", "trainer"), ("context4", FEW_KV, "context4", "trainer"),
         ("ulysses_dp2_accumulate2", TEXT, "dp2xsp2", "trainer"), ("lora_ulysses_dp2", TEXT, "dp2xsp2", "trainer")]
CASES += [("vl_ulysses_dp2", VL, "dp2xsp2", "trainer"), ("vl_context2xulysses2", VL, "cp2xsp2", "trainer")] if VL \
    else []
CASES += [("sft_ulysses_dp2", TEXT, "dp2xsp2", "sft")] if _have_trl() else []
CASES += [("fsdp2_ulysses_dp2", TEXT, "dp2xsp2", "trainer")]  # last: the Trainer's FSDP settings live in os.environ
#: accelerate's FSDP plugin as transformers 4.x builds it (from the environment) asks for an accelerator device
FSDP_NEEDS_A_DEVICE = "There are currently no available devices found"


def _refusals_case(rank, folder):
    """Every refusal is raised alike on every rank, before any collective (no rank is left waiting)."""
    import transformers

    from tfcompat.errors import UlyssesError

    _trainer_env(rank)
    flat = transformers.DataCollatorWithFlattening()
    groups = _groups("dp2xsp2")
    tries = {"not patched for sequence parallelism": ({}, flat, {}),
             "without slice_inputs=True": (dict(groups), flat, {}),
             "splits one packed row": (dict(groups, slice_inputs=True), _PaddedCollator(None), {}),
             "label_smoothing_factor": (dict(groups, slice_inputs=True), flat, dict(label_smoothing_factor=0.1))}
    for said, (patch_kw, collator, extra) in tries.items():
        model = tiny_model(TEXT)
        if patch_kw:
            tfcompat.patch(model, **patch_kw)
        with pytest.raises(UlyssesError, match=said):
            args = _args(os.path.join(folder, "refused"), **extra, **_batching("", WORLD))
            _train(_sp_trainer(transformers.Trainer), model, args, _examples(TEXT), collator)
    model = tiny_model(TEXT)
    tfcompat.patch(model, slice_inputs=True, **groups)
    trainer = _sp_trainer(transformers.Trainer)(model=model, args=_args(os.path.join(folder, "refused"),
                                                                        **_batching("", WORLD)),
                                                eval_dataset=_examples(TEXT), data_collator=flat)
    with pytest.raises(UlyssesError, match="evaluation and prediction"):
        trainer.evaluate()


#: one-token examples: no targets (the flattening collator masks a sequence's first token); drawn so that step 1 has
#: micro-batches with and without targets (the test asserts it)
EMPTY_LENGTHS = [1, 5, 1, 1, 3, 6, 1, 4, 2, 1, 7, 1, 1, 3, 5, 1]


class _Counting:
    """A collator (the flattening one, or the padded reference's), noting each micro-batch's target count."""

    def __init__(self, collator):
        self.collator, self.targets = collator, []

    def __call__(self, features):
        out = self.collator(features)
        self.targets.append(int(out["labels"].ne(-100).sum()))
        return out


def _empty_rows_case(rank, folder):
    """Rows without targets, with num_items_in_batch per rank (average_tokens_across_devices=False, 4.x's default):
    the owner's loss is NaN (0 / 0), which the Trainer's NaN filter drops on that rank only. The SP run (Ulysses 2 x
    data parallel 2) against plain DDP over the same 4 ranks on padded batches of the same draws: the logged losses."""
    import transformers

    _trainer_env(rank)
    examples = [{"input_ids": tiny_sequence(TEXT, text=k)} for k in EMPTY_LENGTHS]
    got = {}
    for run in ("sp", "ddp"):
        model = tiny_model(TEXT)
        if run == "sp":
            tfcompat.patch(model, slice_inputs=True, **_groups("dp2xsp2"))
        collator = _Counting(transformers.DataCollatorWithFlattening() if run == "sp" else _PaddedCollator(None))
        args = _args(os.path.join(folder, f"empty-{run}"), average_tokens_across_devices=False,
                     **_batching("", WORLD))
        trainer = _sp_trainer(transformers.Trainer) if run == "sp" else transformers.Trainer
        losses, params = _train(trainer, model, args, examples, collator)
        got[run] = {"losses": losses, "params": params, "targets": collator.targets}
    torch.save(got, os.path.join(folder, f"empty-{rank}.pt"))


def _cases(rank, world, folder):
    cases = [(case, functools.partial(_worker_case, rank, folder, case, name, layout, client))
             for case, name, layout, client in CASES]
    cases.append(("empty_rows", functools.partial(_empty_rows_case, rank, folder)))
    return run_cases(rank, cases + [("refusals", functools.partial(_refusals_case, rank, folder))])


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("trainer-sp"))
    return folder, merged(spawn(_cases, WORLD, folder, timeout=900, collect=True))


def transformers_version():
    import transformers

    return transformers.__version__


def _reference(case, name, client, folder):
    """The single-process Trainer on the padded micro-batches the ranks drew, accumulated over WORLD of them (the
    one-process twin of data parallelism over WORLD ranks: a model whose loss takes num_items_in_batch sums over
    all of them, one that takes none, Qwen2.5-VL, averages the micro-batches' means, as data parallelism does)."""
    import transformers

    model = _model(case, name)
    out = os.path.join(folder, f"{case}-reference")
    if client == "sft":
        import trl

        return _train(trl.SFTTrainer, model, _args(out, trl=trl, **_batching(case, 1)), _sft_dataset(name),
                      processing_class=word_tokenizer())
    vision = SPECS[name].vision
    return _train(transformers.Trainer, model, _args(out, **_batching(case, 1)), _examples(name, vision),
                  _PaddedCollator(model))


@pytest.mark.parametrize("case,name,layout,client", CASES, ids=[c[0] for c in CASES])
def test_sequence_parallel_trainer_equals_the_padded_single_process_run(ran, case, name, layout, client):
    folder, outcomes = ran
    if FSDP_NEEDS_A_DEVICE in outcomes.get(case, ""):
        pytest.skip(f"transformers {transformers_version()}'s Trainer builds accelerate's FSDP plugin, which asks for "
                    f"an accelerator device (5.x's runs FSDP2 on the CPU)")
    assert_ok(outcomes, case)
    got = torch.load(os.path.join(folder, f"{case}.pt"))
    want_losses, want_params = _reference(case, name, client, folder)
    assert len(want_losses) == STEPS and got["losses"] == pytest.approx(want_losses, rel=1e-4, abs=1e-4)
    assert set(got["params"]) == set(want_params)
    start = dict(_model(case, name).named_parameters())
    for n, p in want_params.items():
        # AdamW turns gradients a rounding apart into steps a little apart where a gradient is near zero: a
        # twentieth of the largest step AdamW takes (measured: upstream's own attention forward with tfcompat's call,
        # Qwen2.5-VL over 2 context x 2 Ulysses ranks, 1 of 8,192 elements 4.1e-5 apart, a 48th of it)
        torch.testing.assert_close(got["params"][n], p, rtol=0, atol=0.05 * LR * STEPS, msg=lambda m, n=n: n + m)
    moved = max((want_params[n] - start[n]).abs().max().item() for n in want_params)
    assert moved > LR / 2, "the steps did not move the weights: the comparison would prove nothing"


def test_what_the_sequence_parallel_step_cannot_run_is_refused_on_every_rank(ran):
    """A model not patched for it, or patched without slice_inputs=True, padded batches of several rows, label
    smoothing, evaluation: UlyssesError naming what to change, on all 4 ranks."""
    assert_ok(ran[1], "refusals")


def test_rows_without_targets_log_what_plain_data_parallelism_logs(ran):
    """A micro-batch of one-token rows has no targets: with each rank's own num_items_in_batch its loss is NaN, and
    the Trainer drops it on that rank alone. Every rank now logs its own row's loss (every share of it summed over
    the group), so the logged losses are plain DDP's (before: every rank summed NaN into its loss and logged 0.0),
    and so are the parameters."""
    folder, outcomes = ran
    assert_ok(outcomes, "empty_rows")
    runs = [torch.load(os.path.join(folder, f"empty-{rank}.pt")) for rank in range(WORLD)]
    first = [r["ddp"]["targets"][0] for r in runs]
    assert 0 in first and max(first) > 0, f"step 1 needs rows with and without targets, drew {first}"
    assert [r["sp"]["targets"] for r in runs] == [r["ddp"]["targets"] for r in runs]
    want, got = runs[0]["ddp"]["losses"], runs[0]["sp"]["losses"]
    assert len(want) == STEPS and want[0] > 0
    assert got == pytest.approx(want, rel=1e-4, abs=1e-4, nan_ok=True)
    for n, p in runs[0]["ddp"]["params"].items():
        torch.testing.assert_close(runs[0]["sp"]["params"][n], p, rtol=0, atol=0.02 * LR * STEPS, equal_nan=True,
                                   msg=n)
