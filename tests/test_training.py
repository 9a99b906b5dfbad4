"""The calls real training loops make: activation checkpointing (reentrant and not, transformers' own and
torch's wrapper), ``use_cache`` not passed (train and eval), optimizer steps, deep copies and pickles.

Oracle: the unpatched model on the padded batch, without checkpointing.
"""

import copy
import inspect
import io
import pickle

import pytest
import torch

import tfcompat
from tfcompat.errors import PackingError, TfcompatError
from tfcompat.packing import pack, unpack
from tfcompat.testing import families

from _helpers import (
    BOUNDARY_ONLY,
    calls_per_layer,
    close_to_model,
    grads_by_name,
    linear_attention,
    one_per_shape,
    patchable,
    plan_shape,
)
from _models import forward_kwargs, padded, run_upstream, three_d_positions, tiny_model, tiny_pixels, tiny_sequence

SPECS = families(installed_only=False)  # the family facts, from the public face

ALL = patchable()
# family-independent mechanisms run on one family per plan shape (_helpers.plan_shape); every family's own
# numbers are proven by test_patch's packed == padded sweep and by `tfcompat check`
FAMILIES = one_per_shape(ALL)
VISION = [n for n in FAMILIES if SPECS[n].vision]
CKPT = ["hf_reentrant", "hf_non_reentrant", "torch_wrapper_reentrant", "torch_wrapper_non_reentrant",
        # torch's selective activation checkpointing (the FSDP2 recipe): save matmul outputs, or nothing
        "sac_save_matmul", "sac_save_nothing",
        # a checkpoint wrapper around the token mixer alone (self_attn / linear_attn), reentrant and not
        "mixer_reentrant", "mixer_non_reentrant",
        # the wrapper applied before patch() (frameworks wrap while building the model)
        "mixer_reentrant_before_patch"]


def test_every_plan_shape_has_a_family():
    """The mechanism tests' families cover every plan shape of the installed release."""
    assert {plan_shape(n) for n in FAMILIES} == {plan_shape(n) for n in ALL}
    assert len(FAMILIES) == len({plan_shape(n) for n in FAMILIES})


def _batch(name, image):
    rows = [tiny_sequence(name, text=5, image=image), tiny_sequence(name, text=3),
            tiny_sequence(name, text=4, image=image, image_first=True)]
    ids, mask = padded(rows)
    pixels = tiny_pixels(2 if image else 0)
    return ids, mask, pixels


def _close_all(got, want, what):
    """Gradients (or parameters) by name: close, and any present in one run only exactly zero."""
    for key, g, w in grads_by_name(got, want, what):
        close_to_model(g, w, f"{what} {key}")


def _clean(name):
    return name.replace("_checkpoint_wrapped_module.", "")


def _grads(model):
    return {_clean(n): p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _checkpoint(model, how):
    if how.startswith("hf_"):
        tfcompat.enable_checkpointing(model, reentrant=how == "hf_reentrant")  # either name, every release
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    impl = CheckpointImpl.REENTRANT if how.endswith("_reentrant") and "non" not in how else CheckpointImpl.NO_REENTRANT
    kwargs = {}
    if how.startswith("sac_"):
        import functools

        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

        matmuls = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                   torch.ops.aten.linear.default}

        def policy(ctx, op, *args, **kw):
            save = how == "sac_save_matmul" and op in matmuls
            return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

        impl = CheckpointImpl.NO_REENTRANT
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy)
    mixers = ("self_attn", "linear_attn")
    if how.startswith("mixer_"):
        targets = {id(c) for m in model.modules() for n, c in m.named_children() if n in mixers}
    else:
        targets = {id(m) for m in model.modules() if any(c in mixers for c, _ in m.named_children())}
    if impl is CheckpointImpl.REENTRANT:
        model.enable_input_require_grads()  # reentrant checkpoints need an input that requires grad
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, checkpoint_impl=impl, **kwargs),
        check_fn=lambda m: id(m) in targets)


_REFERENCES: dict = {}


def _reference(name, ids, mask, pixels, weights, train):
    """The unpatched padded run; the inputs are fixed per family (_batch, seeded weights), so it is computed
    once per family and shared by every checkpointing mode."""
    key = (name, train, ids.shape, float(weights.sum()))
    if key not in _REFERENCES:
        _REFERENCES[key] = _reference_run(name, ids, mask, pixels, weights, train)
    return _REFERENCES[key]


def _reference_run(name, ids, mask, pixels, weights, train):
    model = tiny_model(name)
    model.train(train)
    logits = run_upstream(lambda: model(input_ids=ids, attention_mask=mask,
                                        **forward_kwargs(model, ids, **pixels)).logits)
    (logits * weights * mask[..., None]).sum().backward()
    return logits.detach(), _grads(model)


def _packed_call(model, ids, mask, pixels):
    pk = pack(ids, mask, three_d_positions(model, ids, mask, pixels), vision=SPECS[model.config.model_type].vision
              if model.config.model_type in SPECS else None)
    out = model(input_ids=pk.input_ids, position_ids=pk.position_ids, **forward_kwargs(model, pk.input_ids, **pixels))
    return unpack(out.logits, pk), out


def _ckpt_modes(i, name):
    """The modes family ``i`` (of one per plan shape) runs: one of four pairs in turn (transformers' switch,
    torch's wrapper on layers, selective checkpointing, the wrapper on the mixer alone; each pair a reentrant
    and a non-reentrant mode, or the two SAC policies), so every mode runs on several families of different
    shapes and every family under two modes; the mixer pair on every linear-attention family (its mixer is
    another module); the wrapper applied before patch() where it matters (a linear-attention mixer needs the
    layer found through the wrapper) and on the first family."""
    modes = list(CKPT[2 * (i % 4): 2 * (i % 4) + 2])
    if linear_attention(name):
        modes += [m for m in ("mixer_reentrant", "mixer_non_reentrant") if m not in modes]
    if linear_attention(name) or i == 0:
        modes.append("mixer_reentrant_before_patch")
    return modes


def _ckpt_cases():
    for i, name in enumerate(FAMILIES):
        for how in _ckpt_modes(i, name):
            yield pytest.param(name, how, id=f"{how}-{name}")


def test_every_checkpoint_mode_runs():
    """The rotation leaves no mode out, and runs each of the four pairs on two families or more where there are
    eight (the wrapper before patch(): on the first family and every linear-attention one)."""
    runs = [how for _, how in (p.values for p in _ckpt_cases())]
    assert set(runs) == set(CKPT)
    if len(FAMILIES) >= 8:
        assert min(runs.count(m) for m in CKPT[:8]) >= 2, {m: runs.count(m) for m in CKPT}


@pytest.mark.parametrize("name,how", list(_ckpt_cases()))
def test_checkpointed_packed_training_equals_padded(name, how):
    """use_cache not passed, train mode, checkpointed layers: logits and every gradient equal the oracle."""
    image = name in VISION
    ids, mask, pixels = _batch(name, image)
    weights = torch.randn(*ids.shape, 256, generator=torch.Generator().manual_seed(5))
    want, want_grads = _reference(name, ids, mask, pixels, weights, train=True)

    model = tiny_model(name)
    if how.endswith("_before_patch"):
        _checkpoint(model, how.removesuffix("_before_patch"))
    tfcompat.patch(model)
    model.train()
    if not how.endswith("_before_patch"):
        _checkpoint(model, how)
    logits, out = _packed_call(model, ids, mask, pixels)
    (logits * weights * mask[..., None]).sum().backward()
    valid = mask.bool()
    close_to_model(logits[valid].detach(), want[valid], f"{name}/{how} logits")
    grads = _grads(model)
    _close_all(grads, want_grads, f"{name}/{how} grad")


def _patched_text_case(name):
    """A patched tiny model in train mode, a text batch with its loss weights, and the oracle's logits and
    gradients for them (shared with the checkpoint-mode runs)."""
    ids, mask, pixels = _batch(name, False)
    weights = torch.randn(*ids.shape, 256, generator=torch.Generator().manual_seed(5))
    oracle = _reference(name, ids, mask, pixels, weights, train=True)
    model = tiny_model(name)
    tfcompat.patch(model)
    model.train()
    return model, (ids, mask, pixels, weights), oracle


@pytest.mark.parametrize("how", ["hf_reentrant", "mixer_reentrant"])
@pytest.mark.parametrize("name", FAMILIES[:1] + [n for n in FAMILIES if linear_attention(n)][:1])
def test_recomputation_in_another_thread_sees_the_boundaries(name, how):
    """On a GPU, the autograd engine runs backward (and a reentrant checkpoint's recomputation) in its own device
    thread: here backward runs in a fresh thread, where nothing the forward's thread held is visible. The
    recomputed layers and mixers find the step in their replayed arguments: the oracle's gradients."""
    import threading

    model, (ids, mask, pixels, weights), (want, want_grads) = _patched_text_case(name)
    _checkpoint(model, how)
    logits, _ = _packed_call(model, ids, mask, pixels)
    loss = (logits * weights * mask[..., None]).sum()
    errors = []

    def backward():
        try:
            loss.backward()
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    worker = threading.Thread(target=backward)
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive(), "backward in another thread did not finish in 120 s"
    if errors:
        raise errors[0]
    _close_all(_grads(model), want_grads, f"{name}/{how} grad, backward in another thread")


@pytest.mark.parametrize("thread", ["same", "other"])
@pytest.mark.parametrize("name", FAMILIES[:2] + VISION[:1])
def test_checkpoint_around_the_whole_text_model_carries_the_boundaries(name, thread):
    """``checkpoint_wrapper(model.model)`` (non-reentrant) with the boundaries given to the top-level call as
    the flattening collator's keyword arguments (no position ids): the recomputation replays the wrapped
    module's call in backward, outside the top-level call, and still sees them (it was torch's raw
    CheckpointError); backward in this thread or another one (a GPU's autograd thread): the oracle's numbers."""
    import threading

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    model, (ids, mask, pixels, weights), (want, want_grads) = _patched_text_case(name)
    model.model = checkpoint_wrapper(model.model, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    pk = pack(ids, mask)
    out = model(input_ids=pk.input_ids, cu_seq_lens_q=pk.cu_seqlens, cu_seq_lens_k=pk.cu_seqlens,
                max_length_q=pk.max_seqlen, max_length_k=pk.max_seqlen)
    logits = unpack(out.logits, pk)
    loss = (logits * weights * mask[..., None]).sum()
    if thread == "same":
        loss.backward()
    else:
        worker = threading.Thread(target=loss.backward)
        worker.start()
        worker.join(timeout=120)
    valid = mask.bool()
    close_to_model(logits[valid].detach(), want[valid], f"{name} logits")
    _close_all(_grads(model), want_grads, f"{name} grad, checkpoint around the text model")


@pytest.mark.parametrize("source", ["position_ids", "cu_seq_lens", "seq_idx"])
@pytest.mark.parametrize("name", FAMILIES[:2] + VISION[:1])
def test_packed_row_with_labels_gives_the_padded_loss(name, source):
    """labels on a packed row (the row's own ids, no -100 at the sequence starts): upstream's shift would make
    each sequence's last token predict the next one's first; the loss and gradients are the padded batch's.
    With num_items_in_batch: equal where the labels mark the starts -100 (DataCollatorWithFlattening's), a
    PackingError where the count would include the cross-boundary targets."""
    ids, mask, _ = _batch(name, False)
    ref = tiny_model(name)
    ref.train()
    labels = torch.where(mask.bool(), ids, -100)
    want = run_upstream(lambda: ref(input_ids=ids, attention_mask=mask, labels=labels))
    want.loss.backward()
    count = torch.tensor(int((labels[:, 1:] != -100).sum()))
    model = tiny_model(name)
    tfcompat.patch(model)
    model.train()
    pk = pack(ids, mask)
    where = dict(position_ids=pk.position_ids) if source == "position_ids" else dict(
        cu_seq_lens_q=pk.cu_seqlens, cu_seq_lens_k=pk.cu_seqlens, max_length_q=pk.max_seqlen,
        max_length_k=pk.max_seqlen)
    if source == "seq_idx":  # each token's sequence (mamba-style kernels' name): read eagerly as under compile
        n = pk.input_ids.shape[1]
        where = dict(seq_idx=torch.bucketize(torch.arange(n), pk.cu_seqlens[1:].long(), right=True)[None])
    got = model(input_ids=pk.input_ids, labels=pk.input_ids, **where)
    got.loss.backward()
    close_to_model(got.loss.detach(), want.loss.detach(), f"{name} loss")
    _close_all(_grads(model), _grads(ref), f"{name} grad, packed labels")
    starts = pk.cu_seqlens[1:-1].long()
    marked = pk.input_ids.index_fill(1, starts, -100)
    if "num_items_in_batch" not in inspect.signature(type(ref).forward).parameters and not any(
            p.kind is p.VAR_KEYWORD for p in inspect.signature(type(ref).forward).parameters.values()):
        return  # this release's forward takes no num_items_in_batch (4.51-4.52 VL models)
    with torch.no_grad():
        counted = model(input_ids=pk.input_ids, labels=marked, num_items_in_batch=count, **where).loss
        close_to_model(counted, ref(input_ids=ids, attention_mask=mask, labels=labels,
                                    num_items_in_batch=count).loss, f"{name} loss with num_items_in_batch")
        with pytest.raises(PackingError, match="num_items_in_batch counted those targets"):
            model(input_ids=pk.input_ids, labels=pk.input_ids, num_items_in_batch=count, **where)


@BOUNDARY_ONLY
@pytest.mark.parametrize("how", ["model", "layers"])
def test_torch_compile_of_a_patched_model(how):
    """torch.compile of the whole patched model (dynamo, graph breaks allowed), or of each decoder layer (the
    FSDP2 recipe, AOT autograd too): the step's carriers pass through the compiled frames, and the packed
    step's logits and every gradient equal the oracle's."""
    import torch._dynamo

    name = FAMILIES[0]
    model, (ids, mask, pixels, weights), (want, want_grads) = _patched_text_case(name)
    torch._dynamo.reset()
    try:
        if how == "model":
            run = torch.compile(model, backend="eager")
        else:
            for layer in [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]:
                layer.compile(backend="aot_eager")
            run = model
        logits, _ = _packed_call(run, ids, mask, pixels)
        (logits * weights * mask[..., None]).sum().backward()
    finally:
        torch._dynamo.reset()
    valid = mask.bool()
    close_to_model(logits[valid].detach(), want[valid], f"{name} compiled {how} logits")
    _close_all(_grads(model), want_grads, f"{name} compiled {how} grad")


@pytest.mark.parametrize("mode", ["bf16 weights", "bf16 autocast"])
@pytest.mark.parametrize("name", FAMILIES[:1] + VISION[:1])
def test_bf16_packed_step_is_as_close_to_fp32_as_upstream(name, mode):
    """bf16 (weights cast, or CPU autocast over fp32 weights): the patched packed step's logits and every
    gradient stay as close to the fp32 oracle as upstream's own bf16 padded run (within 3x its error, relative
    to the largest value); a packed row attended across its sequences would be off by O(1)."""
    import copy

    image = name in VISION
    ids, mask, pixels = _batch(name, image)
    base = tiny_model(name).train()

    def run(packed_path, dtype):
        model = copy.deepcopy(base)
        px = dict(pixels)
        if mode == "bf16 weights" and dtype != torch.float32:
            model = model.to(dtype)
            px = {k: v.to(dtype) if v.is_floating_point() else v for k, v in px.items()}
        if packed_path:
            tfcompat.patch(model)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16 autocast" and dtype != torch.float32):
            if packed_path:
                logits, _ = _packed_call(model, ids, mask, px)
            else:
                logits = run_upstream(lambda: model(input_ids=ids, attention_mask=mask,
                                                    **forward_kwargs(model, ids, **px)).logits)
        logits = logits.float()[mask.bool()]
        logits.square().mean().backward()
        return logits.detach(), {_clean(n): p.grad.float() for n, p in model.named_parameters() if p.grad is not None}

    want, want_grads = run(False, torch.float32)
    upstream, upstream_grads = run(False, torch.bfloat16)
    got, grads = run(True, torch.bfloat16)

    def err(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))

    assert err(got, want) <= 3 * err(upstream, want) + 2e-3, (err(got, want), err(upstream, want))
    assert grads.keys() == want_grads.keys()
    for key in want_grads:
        bound = 3 * err(upstream_grads[key], want_grads[key]) + 2e-3
        assert err(grads[key], want_grads[key]) <= bound, (key, err(grads[key], want_grads[key]), bound)


@pytest.mark.parametrize("name", FAMILIES)
def test_default_use_cache_in_eval_mode(name):
    """No use_cache argument in eval mode: the config's default (True) must not turn the row into one sequence."""
    image = name in VISION
    ids, mask, pixels = _batch(name, image)
    model = tiny_model(name)
    assert model.config.get_text_config().use_cache is not False
    with torch.no_grad():
        want = run_upstream(lambda: model(input_ids=ids, attention_mask=mask,
                                          **forward_kwargs(model, ids, **pixels)).logits)
        tfcompat.patch(model)
        got, out = _packed_call(model, ids, mask, pixels)
    close_to_model(got[mask.bool()], want[mask.bool()], f"{name} eval, default use_cache")


@pytest.mark.parametrize("name", FAMILIES)
def test_three_adamw_steps(name):
    """Patched + packed + checkpointed vs unpatched + padded: the loss of each step and the final weights."""
    image = name in VISION
    ids, mask, pixels = _batch(name, image)
    labels = torch.where(mask.bool(), ids, -100)

    def run(model, packed_path):
        model.train()
        # eps 1e-4: gradients that are zero in exact arithmetic (k_proj biases: softmax ignores a shift
        # shared by all keys) are rounding noise, which Adam's normalisation would blow up to full steps
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
        losses = []
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            if packed_path:
                logits, _ = _packed_call(model, ids, mask, pixels)
            else:
                logits = run_upstream(lambda: model(input_ids=ids, attention_mask=mask,
                                                    **forward_kwargs(model, ids, **pixels)).logits)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                                     labels[:, 1:].flatten(), ignore_index=-100)
            loss.backward()
            for p in model.parameters():
                # an expert only padding tokens reach gets a zero gradient padded and None packed, and
                # AdamW would decay and count a step for one and skip the other (what DDP/FSDP hand the
                # optimizer for an unused parameter is a zero gradient too)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            opt.step()
            losses.append(loss.item())
        return losses, {_clean(n): p.detach() for n, p in model.named_parameters()}

    want_losses, want = run(tiny_model(name), False)
    model = tiny_model(name)
    tfcompat.patch(model)
    tfcompat.enable_checkpointing(model)
    losses, got = run(model, True)
    assert losses == pytest.approx(want_losses, rel=1e-4, abs=1e-5)
    _close_all(got, want, f"{name} parameter after 3 steps:")


@pytest.mark.parametrize("name", FAMILIES)
def test_deepcopy_pickle_and_save_of_a_patched_model(name):
    """EMA / reference-policy copies: the copy is patched, behaves like the original, and is independent."""
    ids, mask, pixels = _batch(name, False)
    model = tiny_model(name)
    record = tfcompat.patch(model)
    with torch.no_grad():
        want, _ = _packed_call(model, ids, mask, pixels)
        copies = [copy.deepcopy(model), pickle.loads(pickle.dumps(model))]
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        copies.append(torch.load(buffer, weights_only=False))
        plain_want = tiny_model(name)(input_ids=ids, attention_mask=mask).logits
        for i, other in enumerate(copies):
            got, _ = _packed_call(other, ids, mask, pixels)
            assert torch.equal(got, want), f"copy {i}"
            assert tfcompat.patch(other) == record
            assert tfcompat.unpatch(other)
            assert not any("forward" in m.__dict__ for m in other.modules()), f"copy {i}: a forward was left"
            assert torch.equal(other(input_ids=ids, attention_mask=mask).logits, plain_want), f"copy {i} unpatched"
        # the original is untouched by unpatching its copies
        again, _ = _packed_call(model, ids, mask, pixels)
        assert torch.equal(again, want)


#: the fields of a patched module's state in tfcompat 0.3.0 (its _State.__init__ and what patch set on it)
STATE_0_3_0 = {"kind", "family", "remove_padding", "slice_inputs", "dummy_visual", "section", "window", "rope",
               "plan", "group", "world", "saved_forward", "group_lost", "linear_child", "fn", "restored"}


def test_a_bundled_forward_state_pickled_without_its_body_is_refused(monkeypatch):
    """The bundled attention forward is a body patch() binds on each forward-route module's state
    (``_attention/bundled.py``). A model patched and pickled by tfcompat 0.3.0 names no body (its dispatcher held it)
    and names the attention's forward where 0.3.0 kept it (``_step.forwards``): it unpickles, a packed step is refused
    with what to do, not run through another body; patched again, it equals the original."""
    from tfcompat._step.install import _ATTR  # private: the per-module state under test

    name = FAMILIES[0]
    monkeypatch.setenv("TFCOMPAT_ROPE_IMPL", "native")  # tfcompat's own rotation: the bundled forward on any release
    ids, mask, pixels = _batch(name, False)
    model = tiny_model(name)
    tfcompat.patch(model)
    states = [getattr(m, _ATTR) for m in model.modules() if getattr(getattr(m, _ATTR, None), "kind", "") == "attention"]
    assert states and all(st.carrier == "forward" and st.body is not None for st in states)
    with torch.no_grad():
        want, _ = _packed_call(model, ids, mask, pixels)
        for m in model.modules():  # every state as 0.3.0 pickled it: its fields only (359754b's _State)
            st = getattr(m, _ATTR, None)
            if st is not None:
                st.__dict__ = dict({k: v for k, v in st.__dict__.items() if k in STATE_0_3_0}, cgroup=None, cworld=1)
        data = pickle.dumps(model, protocol=2)  # GLOBAL opcodes: module and name spelled out, as text
        now = b"ctfcompat._attention.attend\nattention_forward\n"
        then = b"ctfcompat._step.forwards\nattention_forward\n"  # where 0.3.0 kept it
        assert now in data
        old = pickle.loads(data.replace(now, then))
        with pytest.raises(TfcompatError, match="patched by an earlier tfcompat and then pickled"):
            _packed_call(old, ids, mask, pixels)
        tfcompat.patch(old)
        got, _ = _packed_call(old, ids, mask, pixels)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen3_vl", "qwen3_5", "qwen2"])
def test_patch_state_cannot_lie(name):
    if name not in FAMILIES:
        pytest.skip("not in this release")
    from _models import text_model

    ids, mask, pixels = _batch(name, False)
    model = tiny_model(name)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        first = tfcompat.patch(model)
        packed_once, _ = _packed_call(model, ids, mask, pixels)
        inner = text_model(model)
        # unpatch a part, patch the whole again: everything is patched again
        tfcompat.unpatch(inner)
        record = tfcompat.patch(model)
        assert record == first and record.attention_modules > 0
        assert torch.equal(_packed_call(model, ids, mask, pixels)[0], packed_once)
        # nested patching of a submodule: no recursion, same behaviour
        tfcompat.patch(inner)
        tfcompat.patch(model)
        assert torch.equal(_packed_call(model, ids, mask, pixels)[0], packed_once)
        assert tfcompat.unpatch(model)
        assert not any("forward" in m.__dict__ for m in model.modules())
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, want)


@pytest.mark.parametrize("name", FAMILIES)
def test_remove_padding_false_changes_nothing(name):
    """remove_padding=False without a group: bit-identical to the unpatched model on any input."""
    ids, mask, pixels = _batch(name, False)
    pk = pack(ids, mask, vision=False)
    model = tiny_model(name)
    calls = [dict(input_ids=ids, attention_mask=mask), dict(input_ids=pk.input_ids, position_ids=pk.position_ids),
             dict(input_ids=pk.input_ids)]
    with torch.no_grad():
        want = [model(**c).logits for c in calls]
        record = tfcompat.patch(model, remove_padding=False)
        assert record.attention_modules == 0 and record.linear_attention_modules == 0
        got = [model(**c).logits for c in calls]
    for w, g in zip(want, got):
        assert torch.equal(w, g)


@pytest.mark.parametrize("name", VISION)
def test_one_unpacked_sample_with_an_image_is_not_cut(name):
    """Batch 1, mask of ones, an image (repeated temporal positions): the model's own path, unchanged."""
    ids = torch.tensor([tiny_sequence(name, text=6, image=True)])
    pixels = tiny_pixels(1)
    model = tiny_model(name)
    with torch.no_grad():
        want = run_upstream(lambda: model(input_ids=ids, attention_mask=torch.ones_like(ids),
                                          **forward_kwargs(model, ids, **pixels)).logits)
        # without a mask upstream is the oracle too (Qwen2.5-Omni then positions the image as text); every release
        # of the matrix runs it (4.51.3-5.25.0: checked family by family), so nothing is caught here
        want_nomask = model(input_ids=ids, **forward_kwargs(model, ids, **pixels)).logits
        tfcompat.patch(model)
        got = model(input_ids=ids, attention_mask=torch.ones_like(ids), **forward_kwargs(model, ids, **pixels)).logits
        got_nomask = model(input_ids=ids, **forward_kwargs(model, ids, **pixels)).logits
    assert torch.equal(got, want)
    close_to_model(got_nomask, want_nomask, f"{name} one sample, no mask")


@pytest.mark.parametrize("name", VISION)
def test_text_only_batch_reaches_every_vision_weight(name):
    """Patched model, training mode, text-only batch with labels: every vision weight gets a zero gradient
    (DDP and FSDP need them on every rank), and the loss and logits are bit-identical to the unpatched model."""
    ids, mask, _ = _batch(name, False)
    labels = torch.where(mask.bool(), ids, -100)

    def loss_of(out):  # not labels=: transformers 4.52's Qwen2-VL loss reads a config.vocab_size it lacks
        return torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                                 ignore_index=-100)

    plain = tiny_model(name)
    plain.train()
    want = plain(input_ids=ids, attention_mask=mask)
    model = tiny_model(name)
    tfcompat.patch(model)
    model.train()
    with torch.autograd.set_detect_anomaly(True):  # no in-place op on a tensor autograd needs
        got = model(input_ids=ids, attention_mask=mask)
        loss_of(got).backward()
    assert torch.equal(got.logits, want.logits) and torch.equal(loss_of(got), loss_of(want))
    visual = [(n, p) for n, p in model.named_parameters() if "visual" in n]
    assert visual
    for n, p in visual:
        assert p.grad is not None and torch.count_nonzero(p.grad) == 0, n
    # the packed path too, and dummy_visual=False turns it off
    _, out = _packed_call(model, ids, mask, {})
    tfcompat.patch(model, dummy_visual=False)
    model.zero_grad(set_to_none=True)
    loss_of(model(input_ids=ids, attention_mask=mask)).backward()
    assert all(p.grad is None for n, p in model.named_parameters() if "visual" in n)


@pytest.mark.parametrize("name", VISION)
def test_dummy_visual_does_not_overflow_in_half_precision(name):
    """Large finite vision features in fp16: weighting before summing keeps inf * 0 = NaN out of the loss."""
    from tfcompat.embeds import _vl_model, dummy_visual_zero

    model = tiny_model(name).to(torch.float16)

    def big(t):  # finite fp16 values whose plain sum overflows; still a function of every vision weight
        return t + (60000.0 - t.detach())

    def hook(module, inputs, out):
        if isinstance(out, torch.Tensor):
            return big(out)
        if getattr(out, "pooler_output", None) is not None:
            out.pooler_output = big(out.pooler_output)
            return out
        return (big(out[0]),) + tuple(out[1:])

    _vl_model(model).visual.register_forward_hook(hook)
    assert not torch.isfinite(torch.full((4, 128), 60000.0, dtype=torch.float16).sum()), "fp16 sum must overflow"
    zero = dummy_visual_zero(model)
    assert zero.dtype == torch.float32 and torch.isfinite(zero) and zero.item() == 0.0


def _actor_batch(name, image):
    """An RL actor step as frameworks build it: left-padded prompts, right-padded responses."""
    prompts = [tiny_sequence(name, text=3, image=image), tiny_sequence(name, text=5),
               tiny_sequence(name, text=2, image=image, image_first=True)]
    responses = [[30, 31, 32, 33], [40, 41], [50, 51, 52]]
    p_len, r_len = max(map(len, prompts)), max(map(len, responses))
    ids = torch.zeros(len(prompts), p_len + r_len, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, p_len - len(p): p_len] = torch.tensor(p)
        ids[i, p_len: p_len + len(r)] = torch.tensor(r)
        mask[i, p_len - len(p): p_len + len(r)] = 1
    response_mask = torch.zeros_like(mask)
    response_mask[:, p_len:] = mask[:, p_len:]
    pixels = tiny_pixels(2 if image else 0)
    return ids, mask, response_mask, pixels


def _rl_cases():
    """Text families: per-sample ids, with and without the cu kwargs. Vision families: the (4, batch, seq) and
    (batch, 4, seq) layouts in turn, and the cu kwargs."""
    for name in FAMILIES:
        layouts = [("4bs", "b4s")[VISION.index(name) % 2] if name in VISION else "4bs", "cu_kwargs"]
        for layout in layouts:
            yield pytest.param(name, layout, id=f"{layout}-{name}")


def test_every_rl_layout_runs():
    if len(VISION) >= 2:
        assert {p.values[1] for p in _rl_cases()} == {"4bs", "b4s", "cu_kwargs"}


@pytest.mark.parametrize("name,layout", list(_rl_cases()))
def test_rl_actor_step_with_framework_shaped_inputs(name, layout):
    """Position ids built per sample ((4, batch, seq) or (batch, 4, seq), text row first), unpadded into one
    (4, 1, total) row, with or without cu_seq_lens_q/k + max_length_q/k: log-probs of every response token
    and every gradient equal the unpatched model on the padded batch."""
    from tfcompat.embeds import rope_index

    image = name in VISION
    ids, mask, response_mask, pixels = _actor_batch(name, image)
    vision = SPECS[name].vision
    plain = tiny_model(name)
    plain.train()

    def logprobs(logits, targets):
        return torch.log_softmax(logits.float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    want = logprobs(plain(input_ids=ids, attention_mask=mask, **forward_kwargs(plain, ids, **pixels)).logits[:, :-1],
                    ids[:, 1:])
    (want * response_mask[:, 1:]).sum().backward()
    want_grads = _grads(plain)

    text = (mask.cumsum(-1) - 1).clamp(min=0)
    if vision:
        mrope, _ = rope_index(plain.config, ids, attention_mask=mask, image_grid_thw=pixels.get("image_grid_thw"))
        pos = torch.cat((text.unsqueeze(0), mrope), dim=0)  # (4, batch, seq)
        if layout == "b4s":
            pos = pos.transpose(0, 1)  # what some frameworks store per sample
    else:
        pos = text
    keep = mask.bool().flatten()
    flat_ids = ids.flatten()[keep].unsqueeze(0)
    if vision:
        rows = pos.transpose(0, 1) if layout == "b4s" else pos
        flat_pos = rows.flatten(1)[:, keep].unsqueeze(1)  # (4, 1, total)
    else:
        flat_pos = pos.flatten()[keep].unsqueeze(0)
    lengths = mask.sum(-1)
    cu = torch.cat((torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)))
    kw = {}
    if layout == "cu_kwargs":
        kw = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=int(lengths.max()), max_length_k=int(lengths.max()))
    model = tiny_model(name)
    tfcompat.patch(model)
    model.train()
    tfcompat.enable_checkpointing(model)
    logits = model(input_ids=flat_ids, position_ids=flat_pos, **kw, **forward_kwargs(model, flat_ids, **pixels)).logits
    got = torch.zeros(ids.shape[0] * ids.shape[1], logits.shape[-1]).index_copy(
        0, torch.nonzero(keep).flatten(), logits[0].float()).view(*ids.shape, -1)
    got = logprobs(got[:, :-1], ids[:, 1:])
    (got * response_mask[:, 1:]).sum().backward()
    sel = response_mask[:, 1:].bool()
    close_to_model(got[sel].detach(), want[sel].detach(), f"{name}/{layout} response log-probs")
    _close_all(_grads(model), want_grads, f"{name}/{layout} grad")


@pytest.mark.parametrize("name", VISION)
def test_mm_token_type_ids_supplied_where_the_forward_takes_them(name):
    """5.3+ forwards need mm_token_type_ids with pixels; the patched model computes them when absent."""
    import inspect

    ids, mask, pixels = _batch(name, True)
    model = tiny_model(name)
    if "mm_token_type_ids" not in inspect.signature(type(model).forward).parameters:
        pytest.skip("this release's forward does not take mm_token_type_ids")
    with torch.no_grad():
        want = run_upstream(lambda: model(input_ids=ids, attention_mask=mask,
                                          **forward_kwargs(model, ids, **pixels)).logits)
        tfcompat.patch(model)
        got = model(input_ids=ids, attention_mask=mask, **pixels).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", FAMILIES)
def test_no_per_layer_host_syncs(name):
    """Boundaries as cu_seq_lens_q + max_length_q: the host syncs that tfcompat's code causes in a packed forward
    (aten._local_scalar_dense, what .item()/.tolist()/int(tensor) dispatch; attributed by the innermost frame
    outside torch) happen once per step, not once per layer. Upstream's own (MoE routing) are not counted."""
    ids, mask, _ = _batch(name, False)
    pk = pack(ids, mask, vision=SPECS[name].vision)
    counts = []
    for layers in (2, 4):
        kw = {"num_hidden_layers": layers}
        if linear_attention(name):
            kw["layer_types"] = ["linear_attention", "full_attention"] * (layers // 2)
        model = tiny_model(name, **kw)
        tfcompat.patch(model)
        with torch.no_grad(), _count_syncs() as count:
            model(input_ids=pk.input_ids, position_ids=pk.position_ids, cu_seq_lens_q=pk.cu_seqlens,
                  max_length_q=pk.max_seqlen)
        counts.append(count.syncs)
    # on CPU the per-step validation reads boundaries with .tolist(), which dispatches no scalar op, so the
    # count may be 0; a per-layer int(tensor) / .item() / bool(tensor) would make it grow with the layers
    assert counts[0] == counts[1], f"tfcompat's host syncs grow with the layers: {counts} for 2 and 4 layers"


def _count_syncs():
    """A dispatch mode counting the host syncs tfcompat's own code causes (aten._local_scalar_dense, attributed
    by the innermost frame outside torch)."""
    import os
    import sys

    from torch.utils._python_dispatch import TorchDispatchMode

    package = os.path.dirname(tfcompat.__file__) + os.sep
    torch_dir = os.path.dirname(torch.__file__) + os.sep

    class Count(TorchDispatchMode):
        syncs = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                frame = sys._getframe(1)
                while frame is not None and frame.f_code.co_filename.startswith(torch_dir):
                    frame = frame.f_back
                if frame is not None and frame.f_code.co_filename.startswith(package):
                    self.syncs += 1
            return func(*args, **(kwargs or {}))

    return Count()


def _first_everywhere(names):
    """The first name runs in every environment, the rest on the boundary releases (tox.ini): the property is the
    package's structure, whose per-release paths the boundary environments cover."""
    return [n if i == 0 else pytest.param(n, marks=BOUNDARY_ONLY) for i, n in enumerate(names)]


@pytest.mark.parametrize("name", _first_everywhere(VISION))
def test_vision_check_syncs_once_per_step(name):
    """A packed row with images: the vision-boundary check reads the boundaries on the device and syncs once per
    step, not once per sequence (a row of 2 sequences and one of 6 cause the same count)."""
    model = tiny_model(name)
    tfcompat.patch(model)
    counts = []
    for extra in (0, 4):
        rows = [tiny_sequence(name, text=5, image=True)] + [tiny_sequence(name, text=3)] * (1 + extra)
        ids, mask = padded(rows)
        pixels = tiny_pixels(1)
        pk = pack(ids, mask, three_d_positions(model, ids, mask, pixels), vision=True)
        with torch.no_grad(), _count_syncs() as count:
            model(input_ids=pk.input_ids, position_ids=pk.position_ids, cu_seq_lens_q=pk.cu_seqlens,
                  max_length_q=pk.max_seqlen, **forward_kwargs(model, pk.input_ids, **pixels))
        counts.append(count.syncs)
    assert counts[0] == counts[1], f"tfcompat's host syncs grow with the sequences of a VL row: {counts} for 2 and 6"


@pytest.mark.parametrize("name", _first_everywhere([n for n in FAMILIES if not SPECS[n].vision]) +
                         _first_everywhere(VISION))
def test_per_layer_calls(name):
    """Per layer of a packed step, tfcompat's Python runs at most 12 function calls and no inspect call: the
    layers read their arguments, the step and what patch time bound (the rotation and the attention call are
    bound once per step). Counted with sys.setprofile over one forward at 2 and 6 layers."""
    per_layer, counts = _per_layer(name)
    limit = 12 if not linear_attention(name) else 12 + 6  # a linear mixer's layer: one call per packed sequence
    assert per_layer["tfcompat"] <= limit, f"{name}: {per_layer['tfcompat']} tfcompat calls per layer ({counts})"
    assert per_layer["inspect"] == 0, f"{name}: {per_layer['inspect']} inspect calls per layer ({counts})"


def _per_layer(name):
    ids, mask, _ = _batch(name, False)
    pk = pack(ids, mask, vision=SPECS[name].vision)

    def build(layers):
        kw = {"num_hidden_layers": layers}
        if linear_attention(name):
            kw["layer_types"] = ["linear_attention", "full_attention"] * (layers // 2)
        model = tiny_model(name, **kw)
        tfcompat.patch(model)
        return model

    return calls_per_layer(build, dict(input_ids=pk.input_ids, position_ids=pk.position_ids,
                                       cu_seq_lens_q=pk.cu_seqlens, max_length_q=pk.max_seqlen, use_cache=False))


def _stand_in_flash(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                    softmax_scale=None, causal=False, window_size=(-1, -1), deterministic=False, **kwargs):
    """flash-attn 2's flash_attn_varlen_func as called (the same positional and keyword names; a query i sees the
    keys i - left .. i + right of window_size, -1 unbounded, and none after it when causal), computed per sequence
    with SDPA: a stand-in registered where tfcompat looks the real one up (flash-attn needs CUDA)."""
    outs = []
    bounds = cu_seqlens_q.tolist()
    left, right = window_size
    for a, b in zip(bounds[:-1], bounds[1:]):
        i = torch.arange(b - a)
        dist = i[:, None] - i[None, :]
        mask = torch.ones(b - a, b - a, dtype=torch.bool)
        if causal:
            mask &= dist >= 0
        if left >= 0:
            mask &= dist <= left
        if right >= 0:
            mask &= -dist <= right
        qs, ks, vs = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, scale=softmax_scale, enable_gqa=True)[0].transpose(0, 1))
    return torch.cat(outs)


def _stand_in_torch(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                    enable_gqa=False, **kwargs):
    """torch's varlen_attn as called: window_size (left, right) with right 0 for causal attention."""
    left, right = window_size
    return _stand_in_flash(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, softmax_scale=scale,
                           causal=right == 0, window_size=(left, -1))


def _stand_in_flash3(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                     seqused_k=None, softmax_scale=None, causal=False, window_size=(-1, -1), deterministic=False,
                     return_attn_probs=False, **kwargs):
    """flash-attn 3's flash_attn_varlen_func as called (its own names; no dropout), returning ``(out, lse)`` as
    older builds do whatever ``return_attn_probs`` says: tfcompat takes the output."""
    out = _stand_in_flash(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale,
                          causal=causal, window_size=window_size)
    return out, torch.zeros(q.shape[1], q.shape[0])


@pytest.mark.parametrize("kind", ["flash_attn_3", "flash_attn", "torch_varlen"])
def test_per_layer_calls_on_the_gpu_kernels(kind, monkeypatch):
    """The GPU kernels' path (flash-attn's varlen function, torch's varlen_attn) through the patched model, with
    stand-ins registered where tfcompat looks the real ones up and the kernel chosen for these CPU tensors: the
    step binds the proven kernel once, so a layer makes no more calls than on the SDPA path (at most 12; before
    the step bound its call: 15 and 16)."""
    from tfcompat._attention import (
        kernel_choice,
        kernels,  # private: the kernel chosen for CPU tensors is set here
    )
    from tfcompat._kernels import table

    seen = []

    def chosen(q, dropout_p):
        seen.append(q.shape)
        return kind

    monkeypatch.setattr(kernels, "_kind", chosen)
    monkeypatch.setattr(kernel_choice, "_FLASH", _stand_in_flash)
    monkeypatch.setattr(kernel_choice, "_FLASH3", _stand_in_flash3)
    monkeypatch.setattr(kernel_choice, "torch_varlen", lambda: _stand_in_torch)
    monkeypatch.setattr(kernel_choice, "torch_takes_gqa", lambda: True)
    try:
        per_layer, counts = _per_layer("qwen2")
        proven = [r for r in table.proven() if r.get("kernel") == kind]
    finally:
        tfcompat.clear_cache()  # the stand-in's proof is not a CPU kernel's
    assert seen and proven and all(r["ok"] for r in proven), proven  # the stand-in served, proven on first use
    assert per_layer["tfcompat"] <= 12, f"{kind}: {per_layer['tfcompat']} tfcompat calls per layer ({counts})"
    assert per_layer["inspect"] == 0
