"""Context parallelism (``patch(model, context_group=group)``) over 4 gloo ranks: more ranks than key/value
heads, packed rows whose sequences span chunks and ranks, activation checkpointing, images split across
ranks, verl's whole-row call, two AdamW steps equal to the single-process padded run, and context parallel
x Ulysses on a 2x2 DeviceMesh.

The workers are spawned once for the module and run every case; each test asserts its case on every rank.
"""

import functools
import importlib.util

import pytest
import torch
import torch.distributed as dist

import tfcompat
from tfcompat.embeds import rope_index
from tfcompat.errors import PackingError, UlyssesError
from tfcompat.packing import pack, unpack
from tfcompat.testing import families
from tfcompat.ulysses import gather_from_ranks, slice_for_rank

from _dist import assert_ok, merged, run_cases, sequence_groups, spawn
from _helpers import SPAWNED_RANKS_SKIPPED, close_to_model, linear_attention, patchable
from _models import (
    forward_kwargs,
    generate_on_this_rank,
    padded,
    split_vision_hidden,
    tiny_model,
    tiny_pixels,
    tiny_sequence,
)

SPECS = families(installed_only=False)  # the family facts, from the public face

pytestmark = pytest.mark.xdist_group("context")
if SPAWNED_RANKS_SKIPPED:
    pytest.skip("context parallelism runs on the boundary releases of the matrix (tox.ini says which)",
                allow_module_level=True)

WORLD = 4
HAVE = patchable()
# the mechanism is family-independent: a plain GQA decoder, GLM's partial interleaved rotary, qk-norm + MoE,
# where the release has them (the whole set of plan shapes ran once, 2026-12-01: all equal); every family's
# packed numbers: test_patch and `tfcompat check`
TEXT = [n for n in ("qwen2", "glm4", "qwen3_moe") if n in HAVE and not linear_attention(n)]
VISION = [n for n in ("qwen2_vl", "qwen3_vl") if n in HAVE]
PEFT = importlib.util.find_spec("peft") is not None
SHARD_LAYOUTS = ("ulysses", "context", "2x2")
PRELOAD_FAMILIES = TEXT + VISION  # imported once in the forkserver (_dist), not in every rank


def _rows(name, vision=False):
    """Sequences of 13, 5 (with an image), 2 and 9 tokens: one longer than a chunk, one shorter than a
    rank's share, boundaries inside chunks and between ranks."""
    return [tiny_sequence(name, text=13), tiny_sequence(name, text=5, image=vision), tiny_sequence(name, text=2),
            tiny_sequence(name, text=9)]


def _summed_grads_close(model, ref, rank):
    failures = []
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(grad)
        want = q.grad if q.grad is not None else torch.zeros_like(q)
        try:
            close_to_model(grad, want, f"rank {rank} grad {n}")
        except AssertionError as exc:
            failures.append(str(exc)[:400])
    assert not failures, "\n".join(failures[:3])


def _text_worker(rank, world, name, ckpt):
    """Sliced by context_group (2 kv heads over 4 ranks), checkpointed: logits and every gradient (summed over
    the ranks) equal the unpatched model on the padded batch."""
    rows = _rows(name)
    ids, mask = padded(rows)
    pk = pack(ids, mask)
    total = pk.input_ids.shape[1]
    weights = torch.randn(*ids.shape, 256, generator=torch.Generator().manual_seed(3))
    ref = tiny_model(name, num_key_value_heads=2)
    ref.train()
    want = ref(input_ids=ids, attention_mask=mask).logits
    (want * weights * mask[..., None]).sum().backward()

    model = tiny_model(name, num_key_value_heads=2)
    record = tfcompat.patch(model, context_group=dist.group.WORLD)
    assert (record.ulysses_world_size, record.context_world_size) == (1, world)
    model.train()
    if ckpt:
        tfcompat.enable_checkpointing(model, reentrant=ckpt == "reentrant")
    group = dict(context_group=dist.group.WORLD)
    local_ids = slice_for_rank(pk.input_ids, dim=1, **group)
    local_pos = slice_for_rank(pk.position_ids, dim=pk.position_ids.dim() - 1, **group)
    local = model(input_ids=local_ids, position_ids=local_pos).logits
    got = unpack(gather_from_ranks(local, dim=1, length=total, **group), pk)
    (got * weights * mask[..., None]).sum().backward()
    valid = mask.bool()
    close_to_model(got.detach()[valid], want.detach()[valid], f"rank {rank} logits")
    _summed_grads_close(model, ref, rank)


def _peft_worker(rank, world, name):
    """PEFT LoRA on the attention projections, then patch(context_group=...): the packed row split over the
    ranks gives the unpatched LoRA model's logits on the padded batch, and every gradient (the LoRA weights';
    the frozen base gets none on either side) summed over the ranks equals its."""
    import peft

    rows = _rows(name)
    ids, mask = padded(rows)
    pk = pack(ids, mask)
    total = pk.input_ids.shape[1]
    weights = torch.randn(*ids.shape, 256, generator=torch.Generator().manual_seed(4))
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False)

    def lora_model():
        base = tiny_model(name, num_key_value_heads=2)
        torch.manual_seed(1)  # the same LoRA weights for both
        return peft.get_peft_model(base, peft.LoraConfig(**lora))

    ref = lora_model()
    ref.train()
    want = ref(input_ids=ids, attention_mask=mask).logits
    (want * weights * mask[..., None]).sum().backward()
    model = lora_model()
    tfcompat.patch(model, context_group=dist.group.WORLD)
    model.train()
    group = dict(context_group=dist.group.WORLD)
    local = model(input_ids=slice_for_rank(pk.input_ids, dim=1, **group),
                  position_ids=slice_for_rank(pk.position_ids, dim=1, **group)).logits
    got = unpack(gather_from_ranks(local, dim=1, length=total, **group), pk)
    (got * weights * mask[..., None]).sum().backward()
    valid = mask.bool()
    close_to_model(got.detach()[valid], want.detach()[valid], f"rank {rank} logits")
    assert any(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)
    _summed_grads_close(model, ref, rank)


def _adamw_worker(rank, world, name):
    """Two AdamW steps: the loss per step and every final parameter equal the single-process padded run (each
    rank's loss covers its own tokens; the gradients are summed over the ranks, as FSDP/DDP would)."""
    rows = _rows(name)
    ids, mask = padded(rows)
    labels = ids.masked_fill(~mask.bool(), -100)
    pk = pack(ids, mask)
    pk_labels = torch.cat([torch.cat((r[1:], torch.tensor([-100]))) for r in
                           (torch.tensor(x) for x in rows)])[None]
    ref = tiny_model(name, num_key_value_heads=2)
    model = tiny_model(name, num_key_value_heads=2)
    tfcompat.patch(model, context_group=dist.group.WORLD)
    ref.train()
    model.train()
    # eps 1e-4 (as test_training): gradients zero in exact arithmetic are rounding noise, which Adam's
    # normalisation would blow up to full steps
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    group = dict(context_group=dist.group.WORLD)
    n_tokens = int((pk_labels != -100).sum())
    for step in range(2):
        logits = ref(input_ids=ids, attention_mask=mask).logits
        shift = labels[:, 1:]
        want = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), shift.reshape(-1),
                                                 ignore_index=-100, reduction="sum") / n_tokens
        opt_ref.zero_grad()
        want.backward()
        opt_ref.step()
        local = model(input_ids=slice_for_rank(pk.input_ids, dim=1, **group),
                      position_ids=slice_for_rank(pk.position_ids, dim=1, **group)).logits
        local_labels = slice_for_rank(pk_labels, dim=1, pad_value=-100, **group)
        mine = torch.nn.functional.cross_entropy(local[0], local_labels[0], ignore_index=-100,
                                                 reduction="sum") / n_tokens
        opt.zero_grad()
        mine.backward()
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
        total = mine.detach().clone()
        dist.all_reduce(total)
        opt.step()
        assert abs(float(total) - float(want)) <= 1e-4 * max(1.0, abs(float(want))), (step, float(total),
                                                                                     float(want))
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        close_to_model(p.detach(), q.detach(), f"rank {rank} param {n} after two AdamW steps")


def _vision_worker(rank, world, name):
    """Embeddings of the full row, then each rank keeps its two chunks (the image spans ranks; Qwen3-VL's
    deepstack rows follow): the text model's hidden states and every gradient equal the single-process run."""
    rows = [tiny_sequence(name, text=6), tiny_sequence(name, text=9, image=True), tiny_sequence(name, text=3)]
    split = dict(context_group=dist.group.WORLD)
    got, want, model, ref = split_vision_hidden(name, rows, split, split)
    close_to_model(got, want, f"rank {rank} hidden")
    _summed_grads_close(model, ref, rank)


def _packed_reference(name):
    """The packed row of ``_rows`` (with an image for VL families), the forward kwargs of the whole row, and
    the single-process patched model's logits on it (backward done with random weights)."""
    vision = SPECS[name].vision
    ids, mask = padded(_rows(name, vision))
    pixels = tiny_pixels(1) if vision else {}
    probe = tiny_model(name)
    if vision:
        pos3, _ = rope_index(probe, ids, image_grid_thw=pixels["image_grid_thw"], attention_mask=mask)
        pk = pack(ids, mask, pos3)
    else:
        pk = pack(ids, mask)
    kw = forward_kwargs(probe, pk.input_ids, **pixels)
    ref = tiny_model(name)
    tfcompat.patch(ref)
    ref.train()
    want = ref(input_ids=pk.input_ids, position_ids=pk.position_ids, **kw).logits
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    (want * weights).sum().backward()
    return pk, kw, ref, want, weights


def _whole_row_worker(rank, world, name):
    """verl's whole-row call under context parallelism: every rank passes the whole packed row; the model
    keeps its two chunks after embedding and returns their logits."""
    pk, kw, ref, want, weights = _packed_reference(name)
    model = tiny_model(name)
    tfcompat.patch(model, context_group=dist.group.WORLD, slice_inputs=True)
    model.train()
    local = model(input_ids=pk.input_ids, position_ids=pk.position_ids, **kw).logits
    got = gather_from_ranks(local, dim=1, length=pk.input_ids.shape[1], context_group=dist.group.WORLD)
    (got * weights).sum().backward()
    close_to_model(got.detach(), want.detach(), f"rank {rank} logits")
    _summed_grads_close(model, ref, rank)


def _two_d_worker(rank, world, name, ckpt):
    """A 2x2 DeviceMesh: context parallel over "cp", Ulysses over "sp" (heads) inside each context shard."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "sp"))
    groups = dict(group=mesh["sp"].get_group(), context_group=mesh["cp"].get_group())
    vision = SPECS[name].vision
    pk, kw, ref, want, weights = _packed_reference(name)
    total = pk.input_ids.shape[1]

    model = tiny_model(name)
    record = tfcompat.patch(model, ulysses_group=groups["group"], context_group=groups["context_group"],
                            slice_inputs=vision)
    assert (record.ulysses_world_size, record.context_world_size) == (2, 2)
    model.train()
    if ckpt:
        tfcompat.enable_checkpointing(model, reentrant=ckpt == "reentrant")
    if vision:  # the whole row on every rank; the model keeps its share after embedding
        local = model(input_ids=pk.input_ids, position_ids=pk.position_ids, **kw).logits
    else:
        local = model(input_ids=slice_for_rank(pk.input_ids, dim=1, **groups),
                      position_ids=slice_for_rank(pk.position_ids, dim=1, **groups)).logits
    got = gather_from_ranks(local, dim=1, length=total, **groups)
    (got * weights).sum().backward()
    close_to_model(got.detach(), want.detach(), f"rank {rank} logits")
    _summed_grads_close(model, ref, rank)


def _ulysses_four_worker(rank, world, name):
    """Ulysses alone over the 4 ranks (4x1): 2 kv heads repeated for the group."""
    rows = _rows(name)
    ids, mask = padded(rows)
    pk = pack(ids, mask)
    total = pk.input_ids.shape[1]
    ref = tiny_model(name, num_key_value_heads=2)
    ref.train()
    want = ref(input_ids=ids, attention_mask=mask).logits
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(3))
    (want * weights * mask[..., None]).sum().backward()
    model = tiny_model(name, num_key_value_heads=2)
    tfcompat.patch(model, ulysses_group=dist.group.WORLD)
    model.train()
    local = model(input_ids=slice_for_rank(pk.input_ids, dim=1),
                  position_ids=slice_for_rank(pk.position_ids, dim=1)).logits
    got = unpack(gather_from_ranks(local, dim=1, length=total), pk)
    (got * weights * mask[..., None]).sum().backward()
    valid = mask.bool()
    close_to_model(got.detach()[valid], want.detach()[valid], f"rank {rank} logits")
    _summed_grads_close(model, ref, rank)


def _explicit_boundaries_worker(rank, world):
    """The whole row's boundaries passed as the flattening collator's keyword arguments beside each rank's slice:
    the same logits as from the sliced position ids, also where the row's padding (7 tokens of 16) is longer than
    every sequence (3 tokens: max_length_q/k name the longest real one); a max_length_k that disagrees is refused
    on every rank. Ulysses over the 4 ranks and context parallel over them alike."""
    rows = [tiny_sequence("qwen2", text=3)] * 3
    pk = pack(*padded(rows))
    cu, longest = pk.cu_seqlens, pk.max_seqlen
    assert longest == 3
    for kw in (dict(context_group=dist.group.WORLD), dict(ulysses_group=dist.group.WORLD)):
        model = tiny_model("qwen2", num_key_value_heads=2)
        tfcompat.patch(model, **kw)
        group = {k: v for k, v in kw.items() if k == "context_group"}
        both = dict(group=kw.get("ulysses_group"), **group)  # gather_from_ranks names the Ulysses group group=
        ids = slice_for_rank(pk.input_ids, dim=1, **group)
        pos = slice_for_rank(pk.position_ids, dim=1, **group)
        n = pk.input_ids.shape[1]
        with torch.no_grad():  # the real tokens (the padding is one sequence here, one per token from positions)
            want = gather_from_ranks(model(input_ids=ids, position_ids=pos).logits, dim=1, length=n, **both)
            got = model(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest,
                        max_length_k=longest).logits
            assert torch.equal(gather_from_ranks(got, dim=1, length=n, **both), want), kw
            with pytest.raises(PackingError, match="max_length_k is 7"):
                model(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, max_length_q=longest, max_length_k=7)


def _shard_boundaries_worker(rank, world, name, how):
    """What DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=False) gives, sliced:
    each rank's ids beside the whole row's cu_seq_lens_q/k and max_length_q/k, no position ids. The positions
    count from 0 in every sequence of the whole row (not of the slice): logits and summed gradients equal the
    unpatched padded batch (they were 1.3e-2..1.9e-2 and 0.36..1.6 off); VL families through the top model."""
    rows = _rows(name)
    ids, mask = padded(rows)
    pk = pack(ids, mask)
    total, cu, longest = pk.input_ids.shape[1], pk.cu_seqlens, pk.max_seqlen
    weights = torch.randn(*ids.shape, 256, generator=torch.Generator().manual_seed(3))
    ref = tiny_model(name, num_key_value_heads=2)
    ref.train()
    want = ref(input_ids=ids, attention_mask=mask).logits
    (want * weights * mask[..., None]).sum().backward()
    model = tiny_model(name, num_key_value_heads=2)
    patch_kw, split = sequence_groups(how)
    tfcompat.patch(model, **patch_kw)
    model.train()
    local_ids = slice_for_rank(pk.input_ids, dim=1, **split)
    local = model(input_ids=local_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest,
                  max_length_k=longest).logits
    got = unpack(gather_from_ranks(local, dim=1, length=total, **split), pk)
    (got * weights * mask[..., None]).sum().backward()
    valid = mask.bool()
    close_to_model(got.detach()[valid], want.detach()[valid], f"rank {rank} logits")
    _summed_grads_close(model, ref, rank)
    with torch.no_grad():
        wrong = slice_for_rank(pk.position_ids + 1, dim=1, **split)  # every rank holds a sequence's token
        with pytest.raises(PackingError, match="do not count from 0 in every sequence"):
            model(input_ids=local_ids, position_ids=wrong, cu_seq_lens_q=cu)
        with pytest.raises(PackingError, match="seq_idx on a sequence-parallel shard"):
            model(input_ids=local_ids, seq_idx=torch.zeros_like(local_ids), cu_seq_lens_q=cu)
        with pytest.raises(PackingError, match=f"ends at {int(cu[-2])} tokens"):  # the last sequence dropped
            model(input_ids=local_ids, cu_seq_lens_q=cu[:-1])


def _vl_shard_refusals_worker(rank, world, name):
    """The top VL model called with this rank's slice of the ids: beside the whole batch's pixels (transformers'
    raw "Image features and image tokens do not match"), or with neither positions nor boundaries (upstream would
    count the mRoPE positions from the slice's first token): refused on every rank, naming what to pass."""
    pk, kw, _, _, _ = _packed_reference(name)
    model = tiny_model(name)
    tfcompat.patch(model, context_group=dist.group.WORLD)
    split = dict(context_group=dist.group.WORLD)
    ids = slice_for_rank(pk.input_ids, dim=1, **split)
    pos = slice_for_rank(pk.position_ids, dim=pk.position_ids.dim() - 1, **split)
    pixels = {k: v for k, v in kw.items() if k != "mm_token_type_ids"}
    with torch.no_grad():
        with pytest.raises(UlyssesError, match="slice_inputs=True"):
            model(input_ids=ids, position_ids=pos, **pixels)
        with pytest.raises(UlyssesError, match="with no position ids"):
            model(input_ids=ids)


def _refusals_worker(rank, world):
    model = tiny_model("qwen2")
    tfcompat.patch(model, context_group=dist.group.WORLD)
    rows = _rows("qwen2")
    pk = pack(*padded(rows))
    with pytest.raises(UlyssesError, match="slice_inputs=True"):  # the whole row on every rank
        model(input_ids=pk.input_ids, position_ids=pk.position_ids)
    for name in [n for n in HAVE if linear_attention(n)][:1]:
        with pytest.raises(UlyssesError, match="linear-attention"):
            tfcompat.patch(tiny_model(name), context_group=dist.group.WORLD)


def _cases(rank, world):
    cases = []
    for i, name in enumerate(TEXT):
        ckpt = ("non_reentrant", "reentrant", None)[i % 3]
        cases.append((f"text:{name}", functools.partial(_text_worker, rank, world, name, ckpt)))
    cases.append(("adamw:qwen2", functools.partial(_adamw_worker, rank, world, "qwen2")))
    if PEFT:
        cases.append(("peft:qwen2", functools.partial(_peft_worker, rank, world, "qwen2")))
    cases.append(("ulysses4:qwen2", functools.partial(_ulysses_four_worker, rank, world, "qwen2")))
    for name in VISION:
        cases.append((f"vision:{name}", functools.partial(_vision_worker, rank, world, name)))
    for name in [n for n in ("qwen2", "qwen2_vl") if n in HAVE]:
        cases.append((f"whole_row:{name}", functools.partial(_whole_row_worker, rank, world, name)))
    for name, ckpt in (("qwen2", "non_reentrant"), ("qwen2_vl", None)):
        if name in HAVE:
            cases.append((f"two_d:{name}", functools.partial(_two_d_worker, rank, world, name, ckpt)))
    for name in [n for n in ("qwen2", "qwen2_vl") if n in HAVE]:
        cases.append((f"generate:{name}", functools.partial(generate_on_this_rank, name, rank,
                                                            dict(context_group=dist.group.WORLD))))
    cases.append(("explicit_boundaries", functools.partial(_explicit_boundaries_worker, rank, world)))
    for name in [n for n in ("qwen2", "qwen2_vl") if n in HAVE]:
        for how in SHARD_LAYOUTS:
            cases.append((f"shard_cu:{name}:{how}",
                          functools.partial(_shard_boundaries_worker, rank, world, name, how)))
        if SPECS[name].vision:
            cases.append((f"vl_shard_refusals:{name}", functools.partial(_vl_shard_refusals_worker, rank, world,
                                                                         name)))
    cases.append(("refusals", functools.partial(_refusals_worker, rank, world)))
    return run_cases(rank, cases)


@pytest.fixture(scope="module")
def outcomes():
    return merged(spawn(_cases, WORLD, timeout=900, collect=True))


@pytest.mark.parametrize("name", TEXT)
def test_context_parallel_equals_padded(outcomes, name):
    assert_ok(outcomes, f"text:{name}")


def test_peft_lora_under_context_parallel(outcomes):
    if not PEFT:
        pytest.skip("PEFT is installed in the tox envs whose release it supports")
    assert_ok(outcomes, "peft:qwen2")


def test_ulysses_alone_over_four_ranks(outcomes):
    assert_ok(outcomes, "ulysses4:qwen2")


def test_two_adamw_steps_equal_the_single_process_run(outcomes):
    assert_ok(outcomes, "adamw:qwen2")


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen3_vl"])
def test_images_split_across_ranks(outcomes, name):
    if name not in HAVE:
        pytest.skip("not in this release")
    assert_ok(outcomes, f"vision:{name}")


@pytest.mark.parametrize("name", ["qwen2", "qwen2_vl"])
def test_whole_row_call(outcomes, name):
    if name not in HAVE:
        pytest.skip("not in this release")
    assert_ok(outcomes, f"whole_row:{name}")


@pytest.mark.parametrize("name", ["qwen2", "qwen2_vl"])
def test_context_times_ulysses_on_a_2x2_mesh(outcomes, name):
    if name not in HAVE:
        pytest.skip("not in this release")
    assert_ok(outcomes, f"two_d:{name}")


@pytest.mark.parametrize("name", ["qwen2", "qwen2_vl"])
def test_generate_with_the_policy_being_trained(outcomes, name):
    """An RL rollout on the context-parallel-patched policy: each rank's own prompts decode as unpatched."""
    if name not in HAVE:
        pytest.skip("not in this release")
    assert_ok(outcomes, f"generate:{name}")


def test_explicit_boundaries_beside_the_slices(outcomes):
    assert_ok(outcomes, "explicit_boundaries")


@pytest.mark.parametrize("how", SHARD_LAYOUTS)
@pytest.mark.parametrize("name", ["qwen2", "qwen2_vl"])
def test_shards_with_the_whole_rows_boundaries_and_no_positions(outcomes, name, how):
    if name not in HAVE:
        pytest.skip("not in this release")
    assert_ok(outcomes, f"shard_cu:{name}:{how}")


def test_vl_slices_with_pixels_or_without_positions_are_refused(outcomes):
    if "qwen2_vl" not in HAVE:
        pytest.skip("not in this release")
    assert_ok(outcomes, "vl_shard_refusals:qwen2_vl")


def test_refusals(outcomes):
    assert_ok(outcomes, "refusals")
