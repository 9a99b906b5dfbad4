"""A patched model driven by the clients users train with: HF Trainer (default arguments, its column filter
reads ``inspect.signature(model.forward)``) fed by transformers' DataCollatorWithFlattening, ``generate()``
in an RL rollout with the policy being trained, fp16 with a GradScaler on text-only batches, TRL's
``SFTTrainer(padding_free=True)`` and PEFT LoRA. (verl's own Ulysses helpers: test_distributed.py.)

Oracle: the unpatched model (padded batch, or its own generate()).
"""

import inspect

import pytest
import torch

import tfcompat
from tfcompat.testing import families

from _helpers import one_per_shape, patchable
from _models import forward_kwargs, padded, run_upstream, tiny_model, tiny_pixels, tiny_sequence, word_tokenizer

SPECS = families(installed_only=False)  # the family facts, from the public face


ALL = patchable()
FAMILIES = one_per_shape(ALL)
VISION = [n for n in FAMILIES if SPECS[n].vision]


@pytest.mark.parametrize("name", ALL)
def test_patched_modules_keep_upstreams_signature(name):
    """Trainer's column filter, generate()'s kwargs validation and prepare_inputs_for_generation read it."""
    model = tiny_model(name)
    want = {id(m): inspect.signature(m.forward) for m in model.modules()}
    tfcompat.patch(model)
    patched = [m for m in model.modules() if "forward" in m.__dict__]
    assert patched
    for m in patched:
        assert inspect.signature(m.forward) == want[id(m)], type(m).__name__


@pytest.mark.parametrize("name,media", [(n, m) for n in FAMILIES for m in
                                         (("image", "video") if SPECS[n].vision else ("text",))])
def test_generate_equals_the_unpatched_model(name, media):
    """Greedy rollout with the policy that trains packed: the unpatched model's tokens and logits."""
    ids = torch.tensor([tiny_sequence(name, text=5, image=media == "image", video=media == "video")])
    pixels = tiny_pixels(int(media == "image"), int(media == "video"))
    model = tiny_model(name)
    kw = dict(forward_kwargs(model, ids, **pixels), attention_mask=torch.ones_like(ids), max_new_tokens=4,
              do_sample=False, output_logits=True, return_dict_in_generate=True)
    try:
        want = model.generate(input_ids=ids, **kw)
    except (ValueError, RuntimeError, StopIteration, TypeError) as exc:
        pytest.skip(f"the unpatched model's own generate() cannot run this tiny {media}: {exc}")
    tfcompat.patch(model)
    got = model.generate(input_ids=ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for step, (g, w) in enumerate(zip(got.logits, want.logits)):
        assert torch.equal(g, w), f"step {step}"


def _text_only_loss(model, ids, mask):
    labels = torch.where(mask.bool(), ids, -100)
    logits = model(input_ids=ids, attention_mask=mask).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                             ignore_index=-100)


@pytest.mark.parametrize("name", VISION)
@pytest.mark.parametrize("how", ["fp16", "autocast_fp16"])
def test_text_only_fp16_step_under_a_grad_scaler(name, how):
    """The dummy visual forward in fp16, the loss scaled by GradScaler's default initial scale (pure fp16: by
    hand, as GradScaler refuses fp16 parameters; autocast: a real GradScaler): vision gradients exactly zero and
    finite, the scaler decides as for the unpatched model, and every other gradient equals the unpatched one."""
    rows = [tiny_sequence(name, text=7), tiny_sequence(name, text=4)]
    ids, mask = padded(rows)
    runs = []
    for patched in (False, True):
        model = tiny_model(name, dtype=torch.float16 if how == "fp16" else None).train()
        if patched:
            tfcompat.patch(model)
        scaler = torch.amp.GradScaler("cpu")
        with torch.autocast("cpu", dtype=torch.float16, enabled=how == "autocast_fp16"):
            try:
                loss = _text_only_loss(model, ids, mask)
            except RuntimeError as exc:
                if patched:
                    raise
                pytest.skip(f"the unpatched model itself cannot run under {how} on this release: {exc}")
        if how == "fp16":
            (loss * scaler.get_scale()).backward()
        else:
            scaler.scale(loss).backward()
            scaler.step(torch.optim.SGD(model.parameters(), lr=0.0))
            scaler.update()
        runs.append(({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, scaler.get_scale()))
    (plain, plain_scale), (got, scale) = runs
    assert scale == plain_scale, "the patched model made the scaler skip a step the unpatched one takes"
    vision = [n for n in got if n not in plain]
    assert vision, "the dummy visual forward reached no vision weight"
    for n in vision:
        assert torch.isfinite(got[n]).all() and not got[n].count_nonzero(), n
    for n, g in plain.items():
        torch.testing.assert_close(got[n], g, rtol=0, atol=0, equal_nan=True, msg=n)


def _examples(name, n=6):
    lengths = [5, 3, 7, 4, 6, 2][:n]
    return [{"input_ids": tiny_sequence(name, text=k)} for k in lengths]


def _trainer_losses(model, examples, collator, tmp_path, batch=3):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (installed by the tox envs)")
    losses = []

    class Record(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=batch, max_steps=3, learning_rate=1e-3, logging_steps=1,
        gradient_checkpointing=True, report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=examples, data_collator=collator,
                                   callbacks=[Record()])
    trainer.train()
    return losses


def _padded_collator(features):
    """The padded twin of DataCollatorWithFlattening: its labels mask each sequence's first token, which no
    position predicts; releases whose Trainer counts the labels for the loss's denominator then agree."""
    ids, mask = padded([f["input_ids"] for f in features])
    labels = torch.where(mask.bool(), ids, -100)
    labels[:, 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("name", [n for n in FAMILIES if not SPECS[n].vision])
def test_trainer_with_the_flattening_collator_equals_padded(name, tmp_path):
    """transformers.Trainer, default arguments (remove_unused_columns=True), gradient checkpointing on, fed by
    DataCollatorWithFlattening with every flag it has: the unpatched Trainer's losses on the padded batches."""
    from transformers import DataCollatorWithFlattening

    params = inspect.signature(DataCollatorWithFlattening).parameters
    flags = {k: True for k in ("return_flash_attn_kwargs", "return_position_ids", "return_seq_idx") if k in params}
    want = _trainer_losses(tiny_model(name), _examples(name), _padded_collator, tmp_path / "padded")
    model = tiny_model(name)
    tfcompat.patch(model)
    got = _trainer_losses(model, _examples(name), DataCollatorWithFlattening(**flags), tmp_path / "packed")
    assert len(want) == 3 and got == pytest.approx(want, rel=1e-4, abs=1e-4)


def test_trainer_with_the_flattening_collator_one_example_per_batch(tmp_path):
    """Batches of one example: each row holds one sequence, its boundaries passed by every flag of the collator
    (validated, then upstream's own path): the unpatched Trainer's losses on the same examples."""
    from transformers import DataCollatorWithFlattening

    name = next(n for n in ("qwen2", "qwen3") if n in ALL)
    params = inspect.signature(DataCollatorWithFlattening).parameters
    flags = {k: True for k in ("return_flash_attn_kwargs", "return_position_ids", "return_seq_idx") if k in params}
    want = _trainer_losses(tiny_model(name), _examples(name), _padded_collator, tmp_path / "padded", batch=1)
    model = tiny_model(name)
    tfcompat.patch(model)
    got = _trainer_losses(model, _examples(name), DataCollatorWithFlattening(**flags), tmp_path / "packed", batch=1)
    assert len(want) == 3 and got == pytest.approx(want, rel=1e-4, abs=1e-4)


def _sft_losses(model, name, padding_free, tmp_path):
    trl = pytest.importorskip("trl", reason="TRL 1.x is installed by the tox envs of transformers >= 4.56.2; "
                              "older TRL collates padding-free rows without position ids unless the model runs "
                              "flash_attention_2, so no model can find the sequences")
    datasets = pytest.importorskip("datasets")
    from transformers import TrainerCallback

    losses = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    examples = datasets.Dataset.from_list([dict(e, labels=[-100] + e["input_ids"][1:]) for e in _examples(name)])
    # TRL's defaults but for the CPU (fp32, as the tests run) and max_length, which padding_free without
    # packing refuses to enforce
    args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=3, max_steps=3, learning_rate=1e-3,
                         logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
                         padding_free=padding_free, max_length=None, bf16=False, gradient_checkpointing=True)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=examples, processing_class=word_tokenizer(),
                             callbacks=[Record()])
    trainer.train()
    return losses


@pytest.mark.parametrize("name", [n for n in FAMILIES if not SPECS[n].vision])
def test_trl_sft_trainer_padding_free_equals_padded(name, tmp_path):
    """TRL's SFTTrainer with padding_free=True (its collator flattens each batch into one row with position
    ids) on a patched model: the per-step losses of the unpatched SFTTrainer on padded batches. The examples
    carry labels that mask each sequence's first token, as TRL's padding-free collator does: without them
    the padded run counts those tokens in the loss's denominator on some releases (5.0: 15 where 12 tokens
    are predicted)."""
    want = run_upstream(lambda: _sft_losses(tiny_model(name), name, False, tmp_path / "padded"))
    model = tiny_model(name)
    tfcompat.patch(model)
    got = _sft_losses(model, name, True, tmp_path / "packed")
    assert len(want) == 3 and got == pytest.approx(want, rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("name,order", [(n, ("patch_then_peft", "peft_then_patch")[i % 2]) for i, n in
                                        enumerate(FAMILIES)] + [(FAMILIES[0], "peft_then_patch")])
def test_peft_lora_packed_equals_padded(name, order):
    """PEFT LoRA on the attention projections, patched before or after get_peft_model: logits and every LoRA
    gradient of the packed row equal the unpatched LoRA model on the padded batch."""
    peft = pytest.importorskip("peft", reason="PEFT is installed in the tox envs whose release it supports")
    from tfcompat.packing import pack, unpack

    from _models import three_d_positions

    vision = SPECS[name].vision
    rows = [tiny_sequence(name, text=5, image=vision), tiny_sequence(name, text=3)]
    ids, mask = padded(rows)
    pixels = tiny_pixels(int(vision))
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False)

    def lora_model(patch_first=False):
        base = tiny_model(name)
        if patch_first:
            tfcompat.patch(base)
        torch.manual_seed(1)  # the same LoRA weights either way
        return peft.get_peft_model(base, peft.LoraConfig(**lora))

    plain = lora_model()
    want = plain(input_ids=ids, attention_mask=mask, **forward_kwargs(plain.get_base_model(), ids, **pixels)).logits
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(2))
    (want * weights * mask[..., None]).sum().backward()
    want_grads = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}

    model = lora_model(patch_first=order == "patch_then_peft")
    if order == "peft_then_patch":
        tfcompat.patch(model)
    pk = pack(ids, mask, three_d_positions(model.get_base_model(), ids, mask, pixels), vision=vision)
    out = model(input_ids=pk.input_ids, position_ids=pk.position_ids,
                **forward_kwargs(model.get_base_model(), pk.input_ids, **pixels)).logits
    got = unpack(out, pk)
    (got * weights * mask[..., None]).sum().backward()
    from _helpers import close_to_model

    close_to_model(got[mask.bool()].detach(), want[mask.bool()].detach(), f"{name}/{order} logits")
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(grads) == set(want_grads) and any("lora_" in n for n in grads)
    for n, g in grads.items():
        close_to_model(g, want_grads[n], f"{name}/{order} grad {n}")
