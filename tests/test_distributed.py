"""Ulysses sequence parallelism and the dummy visual forward under DDP / FSDP2, over gloo.

The two workers are spawned once for the whole module and run every case (spawning costs seconds
per process); each test asserts the outcome of its own case on every rank.
"""

import functools
import os

import pytest
import torch
import torch.distributed as dist

import tfcompat
from tfcompat.embeds import get_input_embeds, rope_index
from tfcompat.errors import UlyssesError
from tfcompat.packing import pack, unpack
from tfcompat.testing import families
from tfcompat.ulysses import gather_from_ranks, slice_for_rank

from _dist import assert_ok, merged, run_cases, spawn
from _helpers import (  # noqa: F401
    SPAWNED_RANKS_SKIPPED,
    close_to_model,
    installed,
    linear_attention,
    one_per_shape,
    patchable,
    verl_ulysses,
)
from _models import (
    generate_on_this_rank,
    padded,
    split_vision_hidden,
    text_model,
    tiny_model,
    tiny_pixels,
    tiny_sequence,
)

SPECS = families(installed_only=False)  # the family facts, from the public face

# the workers are spawned once for the module: under pytest-xdist its tests stay on one worker
pytestmark = pytest.mark.xdist_group("distributed")

if SPAWNED_RANKS_SKIPPED:
    # the patched attention on a slice of the heads, DDP/FSDP2 with a text-only rank and verl's whole-row call:
    # torch's and verl's plumbing around the forwards every environment proves in process (test_patch,
    # test_training, test_embeds), run on the boundary releases of the matrix
    pytest.skip("Ulysses, DDP and FSDP2 over spawned ranks run on the boundary releases of the matrix "
                "(tox.ini says which)", allow_module_level=True)

HAVE = patchable()
# the Ulysses mechanism on one family per plan shape (every family's numbers: test_patch, `tfcompat check`)
ULYSSES = [n for n in one_per_shape(HAVE) if not linear_attention(n)]  # linear attention: refused (tested below)
VISION = [n for n in one_per_shape(HAVE) if SPECS[n].vision]
# verl's whole-row call: a text family and the VL families verl slices (Qwen3-VL: deepstack rows too)
WHOLE_ROW = [n for n in ("qwen2", "qwen2_vl", "qwen3_vl") if n in HAVE]
VERL = verl_ulysses()
# imported once in the forkserver (_dist), not in every rank
PRELOAD_FAMILIES = sorted(set(ULYSSES + VISION + WHOLE_ROW))


def _ulysses_worker(rank, world, name, kv_heads, ckpt):
    """Patched, packed, sliced over 2 ranks, checkpointed, use_cache not passed, train mode == unpatched padded."""
    rows = [tiny_sequence(name, text=7), tiny_sequence(name, text=4), tiny_sequence(name, text=2)]
    ids, mask = padded(rows)
    pk = pack(ids, mask, vision=SPECS[name].vision)
    total = pk.input_ids.shape[1]
    weights = torch.randn(*ids.shape, 256, generator=torch.Generator().manual_seed(3))

    ref = tiny_model(name, num_key_value_heads=kv_heads)
    ref.train()
    want = ref(input_ids=ids, attention_mask=mask).logits
    (want * weights * mask[..., None]).sum().backward()

    model = tiny_model(name, num_key_value_heads=kv_heads)
    record = tfcompat.patch(model, ulysses_group=dist.group.WORLD)
    assert record.ulysses_world_size == world
    model.train()
    if ckpt:
        tfcompat.enable_checkpointing(model, reentrant=ckpt == "reentrant")
    local_ids = slice_for_rank(pk.input_ids, dim=1)
    local_pos = slice_for_rank(pk.position_ids, dim=pk.position_ids.dim() - 1)
    local = model(input_ids=local_ids, position_ids=local_pos).logits
    got = unpack(gather_from_ranks(local, dim=1, length=total), pk)
    (got * weights * mask[..., None]).sum().backward()
    valid = mask.bool()
    close_to_model(got.detach()[valid], want.detach()[valid], f"rank {rank} logits")
    _compare_summed_grads(model, ref, rank)


def _assert_same_on_every_rank(model):
    """Every parameter equal on every rank (all reductions run on every rank before any assert)."""
    differ = []
    for n, p in model.named_parameters():
        t = p.detach()
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        lo, hi = t.clone(), t.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        if not torch.equal(lo, hi):
            differ.append(n)
    assert not differ, f"differ across ranks: {differ[:4]}"


def _compare_summed_grads(model, ref, rank):
    """Sum every parameter's gradient over the ranks (each holds the gradient of its own tokens) and compare
    with the single-process one. Every rank runs every all_reduce before any assert, so a mismatch fails
    the case on every rank instead of leaving a peer waiting in a collective. A missing gradient counts as
    zero (the vision tower of a text-only batch, MoE experts no token was routed to)."""
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


def _bad_heads_worker(rank, world):
    model = tiny_model("qwen2", num_attention_heads=3, num_key_value_heads=1, head_dim=32)
    with pytest.raises(UlyssesError, match="3 attention heads of qwen2 do not divide over 2 ranks"):
        tfcompat.patch(model, ulysses_group=dist.group.WORLD)


def _unequal_lengths_worker(rank, world):
    """Ranks with unequal local lengths: a UlyssesError on every rank (checked before the all-to-all)."""
    model = tiny_model("qwen2")
    tfcompat.patch(model, ulysses_group=dist.group.WORLD)
    n = 4 + rank
    with pytest.raises(UlyssesError, match=r"Ulysses ranks hold \[4, 5\] tokens"):
        model(input_ids=torch.arange(10, 10 + n).view(1, -1), position_ids=torch.arange(n).view(1, -1))
    with pytest.raises(UlyssesError, match="batch 1"):
        model(input_ids=torch.arange(10, 14).view(2, 2), position_ids=torch.arange(2).repeat(2, 1))


def _raw_all_to_all_worker(rank, world):
    """The public all-to-alls check shapes on every rank first: unequal slices and a row that does not split
    raise UlyssesError on every rank (before, a gloo abort of the peer); equal slices round-trip exactly."""
    from tfcompat.ulysses import gather_heads_scatter_seq, gather_seq_scatter_heads

    with pytest.raises(UlyssesError, match=r"the ranks hold tensors of shapes \[\(3, 4, 8\), \(4, 4, 8\)\]"):
        gather_seq_scatter_heads(torch.randn(3 + rank, 4, 8))
    with pytest.raises(UlyssesError, match="5 tokens .* do not divide over a group of 2"):
        gather_heads_scatter_seq(torch.randn(5, 2, 8))
    with pytest.raises(UlyssesError, match="3 heads do not divide"):
        gather_seq_scatter_heads(torch.randn(4, 3, 8))
    x = torch.randn(4, 4, 8, generator=torch.Generator().manual_seed(rank))
    assert torch.equal(gather_heads_scatter_seq(gather_seq_scatter_heads(x)), x)


def _linear_refused_worker(rank, world, name):
    with pytest.raises(UlyssesError, match="linear-attention"):
        tfcompat.patch(tiny_model(name), ulysses_group=dist.group.WORLD)


def _lm_loss(logits, ids):
    # computed here, not with labels=: transformers 4.52's Qwen2-VL loss reads config.vocab_size, which its
    # top-level config lacks (upstream bug)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def _patched_ddp_worker(rank, world, name, mode):
    """The patched model's own forward, rank 1 text-only: every vision weight gets a gradient on both ranks, the
    text-only rank's loss equals the unpatched model's, and the parameters stay identical over two steps."""
    from _models import forward_kwargs

    image = rank == 0
    ids = torch.tensor([tiny_sequence(name, text=5, image=image)])
    pixels = tiny_pixels(1 if image else 0, seed=rank)
    kw = forward_kwargs(tiny_model(name), ids, **pixels)
    plain = tiny_model(name)
    plain.train()
    want = _lm_loss(plain(input_ids=ids, **kw).logits, ids)
    model = tiny_model(name)
    tfcompat.patch(model)
    model.train()
    if mode == "ddp":
        # MoE experts a batch does not route to get no gradient (upstream, every release): DDP must be told;
        # the vision tower must not need it
        moe = any("experts" in n for n, _ in model.named_parameters())
        # Qwen2.5-Omni's audio tower holds a weight its forward never uses (audio_bos_eos_token): DDP must be
        # told there too, with or without tfcompat
        unused = any("audio_bos_eos_token" in n for n, _ in model.named_parameters())
        wrapped = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=moe or unused)
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
        wrapped = model
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(2):
        opt.zero_grad()
        loss = _lm_loss(wrapped(input_ids=ids, **kw).logits, ids)
        if step == 0:
            assert torch.equal(loss.detach(), want.detach()), (loss.item(), want.item())
        loss.backward()
        # what DDP/FSDP need: the same parameters get gradients on every rank, and every tower weight
        # does on the rank without images; a weight upstream's forward never uses (Qwen2.5-Omni's
        # audio_bos_eos_token) gets none anywhere
        have = sorted(n for n, p in model.named_parameters() if p.grad is not None and "experts" not in n)
        every = [None] * world
        dist.all_gather_object(every, have)
        assert all(h == every[0] for h in every), f"ranks differ in which parameters get gradients: " \
            f"{sorted(set(every[0]) ^ set(every[1]))[:4]}"
        towers = [n for n, _ in model.named_parameters() if ".visual." in f".{n}" or "audio_tower." in n]
        unused = [n for n in towers if n not in have and "audio_bos_eos_token" not in n]
        assert not unused, f"tower weights without a gradient on rank {rank}: {unused[:4]}"
        opt.step()
    _assert_same_on_every_rank(model)


def _grad_scale_worker(rank, world):
    """gather_from_ranks' backward against verl's gather_outputs_and_unpad: grad_scale=1 (a loss summed over the
    group) is verl's grad_scaler=False, grad_scale="group" (FSDP/DDP average over the ranks) its default True."""
    from tfcompat.ulysses import gather_from_ranks

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(1, 3, 4, generator=g)
    weights = torch.randn(1, 3 * world, 4, generator=torch.Generator().manual_seed(9))
    grads = {}
    for scale in (1.0, "group", 2.5):
        mine = x.clone().requires_grad_()
        (gather_from_ranks(mine, dim=1, group=dist.group.WORLD, grad_scale=scale) * weights).sum().backward()
        grads[scale] = mine.grad
    own = weights[:, 3 * rank: 3 * rank + 3]
    assert torch.equal(grads[1.0], own) and torch.equal(grads["group"], own * world)
    assert torch.equal(grads[2.5], own * 2.5)
    if VERL is not None:
        for scaler, ours in ((False, grads[1.0]), (True, grads["group"])):
            theirs = x.clone().requires_grad_()
            out = VERL.gather_outputs_and_unpad(theirs, gather_dim=1, grad_scaler=scaler, group=dist.group.WORLD)
            (out * weights).sum().backward()
            assert torch.equal(theirs.grad, ours), scaler
    with pytest.raises(UlyssesError, match="grad_scale"):
        gather_from_ranks(x, dim=1, group=dist.group.WORLD, grad_scale=0)


def _cases(rank, world):
    cases = [("grad_scale", functools.partial(_grad_scale_worker, rank, world))]
    for name in VISION:
        cases.append((f"patched_ddp:{name}", functools.partial(_patched_ddp_worker, rank, world, name, "ddp")))
    for name in ("qwen2_vl", "qwen3_vl"):
        if name in HAVE:
            cases.append((f"patched_fsdp:{name}", functools.partial(_patched_ddp_worker, rank, world, name, "fsdp")))
    for i, name in enumerate(ULYSSES):
        kv = 1 if i % 2 else 2
        ckpt = ("reentrant", "non_reentrant", None)[i % 3]
        cases.append((f"ulysses:{name}", functools.partial(_ulysses_worker, rank, world, name, kv, ckpt)))
    for name in ("qwen2_vl", "qwen3_vl"):
        if name in HAVE:
            cases.append((f"ulysses_vision:{name}", functools.partial(_ulysses_vision_worker, rank, world, name)))
    for name in ("qwen2_vl", "glm4v", "qwen3_vl"):
        if name in HAVE:
            cases.append((f"ddp:{name}", functools.partial(_ddp_worker, rank, world, name, "ddp")))
    cases.append(("fsdp:qwen2_vl", functools.partial(_ddp_worker, rank, world, "qwen2_vl", "fsdp")))
    for name in WHOLE_ROW:
        cases.append((f"whole_row:{name}", functools.partial(_whole_row_worker, rank, world, name)))
    for name in ("qwen2", "qwen2_vl", "qwen3_vl"):
        if name in HAVE:
            for how, kw in (("ulysses", dict(ulysses_group=dist.group.WORLD)),
                            ("whole_row", dict(ulysses_group=dist.group.WORLD, slice_inputs=True))):
                cases.append((f"generate_{how}:{name}", functools.partial(generate_on_this_rank, name, rank, kw)))
    cases.append(("bad_heads", functools.partial(_bad_heads_worker, rank, world)))
    cases.append(("unequal_lengths", functools.partial(_unequal_lengths_worker, rank, world)))
    cases.append(("raw_all_to_all", functools.partial(_raw_all_to_all_worker, rank, world)))
    for name in [n for n in HAVE if linear_attention(n)]:
        if name in HAVE:
            cases.append((f"linear_refused:{name}", functools.partial(_linear_refused_worker, rank, world, name)))
    return run_cases(rank, cases)


@pytest.fixture(scope="module")
def outcomes():
    return merged(spawn(_cases, 2, timeout=900, collect=True))


@pytest.mark.parametrize("name", ULYSSES)
def test_ulysses_with_checkpointing_equals_padded(outcomes, name):
    """World 2; odd families use 1 kv head (a group larger than the kv head count); checkpointing varies."""
    assert_ok(outcomes, f"ulysses:{name}")


@pytest.mark.parametrize("name", VISION)
def test_patched_model_with_a_text_only_rank_under_ddp(outcomes, name):
    assert_ok(outcomes, f"patched_ddp:{name}")


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen3_vl"])
def test_patched_model_with_a_text_only_rank_under_fsdp2(outcomes, name):
    if name not in HAVE:
        pytest.skip("not in this release")
    assert_ok(outcomes, f"patched_fsdp:{name}")


def test_ulysses_refuses_heads_that_do_not_divide(outcomes):
    assert_ok(outcomes, "bad_heads")


def test_gather_grad_scale_matches_verls_gather(outcomes):
    if VERL is None and os.environ.get("TFCOMPAT_EXPECT_CLIENTS", "").count("verl"):
        pytest.fail("verl is expected in this environment (TFCOMPAT_EXPECT_CLIENTS) but not installed")
    assert_ok(outcomes, "grad_scale")


def test_ulysses_unequal_local_lengths_raise_on_every_rank(outcomes):
    assert_ok(outcomes, "unequal_lengths")


def test_raw_all_to_alls_check_shapes_on_every_rank(outcomes):
    assert_ok(outcomes, "raw_all_to_all")


@pytest.mark.parametrize("name", [n for n in HAVE if linear_attention(n)])
def test_ulysses_refuses_linear_attention(outcomes, name):
    assert_ok(outcomes, f"linear_refused:{name}")

class _Step(torch.nn.Module):
    """What a training step does: embeddings (real or dummy vision), decoder, head."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, pixels):
        res = get_input_embeds(self.model, ids, **pixels)
        pos, _ = rope_index(self.model, ids, image_grid_thw=pixels.get("image_grid_thw"),
                            attention_mask=torch.ones_like(ids))
        extra = {}
        if res.deepstack_visual_embeds is not None:
            extra = dict(visual_pos_masks=res.visual_pos_masks, deepstack_visual_embeds=res.deepstack_visual_embeds)
        hidden = text_model(self.model)(inputs_embeds=res.inputs_embeds, position_ids=pos,
                                        attention_mask=torch.ones_like(ids), use_cache=False, **extra)[0]
        return self.model.lm_head(hidden)


def _ddp_worker(rank, world, name, mode):
    model = tiny_model(name)
    model.train()
    step = _Step(model)
    if mode == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(step, find_unused_parameters=False)
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(step)
        wrapped = step
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.5)
    image = rank == 0
    ids = torch.tensor([tiny_sequence(name, text=5, image=image)])
    pixels = tiny_pixels(1 if image else 0, seed=rank)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "visual" in n} if mode == "ddp" else {}
    for _ in range(3):
        opt.zero_grad()
        wrapped(ids, pixels).float().pow(2).mean().backward()
        opt.step()
    _assert_same_on_every_rank(model)
    moved = [n for n, v in before.items() if not torch.equal(v, dict(model.named_parameters())[n].detach())]
    if mode == "ddp":
        assert moved, "vision weights never moved: rank 0's image gradients did not reach the update"


@pytest.mark.parametrize("name", ["qwen2_vl", "glm4v", "qwen3_vl"])
def test_ddp_with_a_text_only_rank(outcomes, name):
    if name not in HAVE:
        pytest.skip("not in this release")
    assert_ok(outcomes, f"ddp:{name}")


def test_fsdp_with_a_text_only_rank(outcomes):
    assert_ok(outcomes, "fsdp:qwen2_vl")


def _ulysses_vision_worker(rank, world, name):
    # the image tokens of the second sequence straddle the two ranks' slices
    rows = [tiny_sequence(name, text=4), tiny_sequence(name, text=5, image=True)]
    got, want, model, ref = split_vision_hidden(name, rows, dict(ulysses_group=dist.group.WORLD), {},
                                                image_on_every_rank=True)
    close_to_model(got, want, f"rank {rank} hidden")
    _compare_summed_grads(model, ref, rank)


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen3_vl"])
def test_ulysses_with_images_and_deepstack(outcomes, name):
    """Embeddings on the full row, then each rank keeps its slice (Qwen3-VL: of the deepstack rows too)."""
    if name not in HAVE:
        pytest.skip("not in this release")
    assert_ok(outcomes, f"ulysses_vision:{name}")


def _whole_row_worker(rank, world, name):
    """verl's whole-row call: every rank passes the whole packed row (ids, positions, pixels; padded by verl's
    own ``ulysses_pad``) to the top-level model patched with slice_inputs=True, which returns this rank's slice
    of the logits; verl's ``gather_outputs_and_unpad`` joins them. Logits and every gradient (summed over the
    ranks) equal the single-process patched model on the same packed row. Without slice_inputs the same call
    is refused, as are labels and rows that differ between ranks."""
    from _models import forward_kwargs

    vision = SPECS[name].vision
    rows = [tiny_sequence(name, text=4), tiny_sequence(name, text=5, image=vision), tiny_sequence(name, text=2)]
    ids, mask = padded(rows)
    pixels = tiny_pixels(1) if vision else {}
    probe = tiny_model(name)
    if vision:
        pos3, _ = rope_index(probe, ids, image_grid_thw=pixels["image_grid_thw"], attention_mask=mask)
        pk = pack(ids, mask, pos3)
    else:
        pk = pack(ids, mask)
    total = pk.input_ids.shape[1]
    kw = forward_kwargs(probe, pk.input_ids, **pixels)

    ref = tiny_model(name)
    tfcompat.patch(ref)
    ref.train()
    want = ref(input_ids=pk.input_ids, position_ids=pk.position_ids, **kw).logits
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    (want * weights).sum().backward()

    model = tiny_model(name)
    tfcompat.patch(model, ulysses_group=dist.group.WORLD, slice_inputs=True)
    model.train()
    if VERL is not None:
        row, pos, pad = VERL.ulysses_pad(pk.input_ids, pk.position_ids, sp_size=world)
    else:
        row, pos, pad = pk.input_ids, pk.position_ids, 0
    kw_row = forward_kwargs(probe, row, **pixels)
    local = model(input_ids=row, position_ids=pos, **kw_row).logits
    assert local.shape[1] == -(-total // world), (tuple(local.shape), total)
    if VERL is not None:
        got = VERL.gather_outputs_and_unpad(local, gather_dim=1, unpad_dim=1, padding_size=pad, grad_scaler=False,
                                            group=dist.group.WORLD)
    else:
        got = gather_from_ranks(local, dim=1, length=total)
    (got * weights).sum().backward()
    close_to_model(got.detach(), want.detach(), f"rank {rank} logits")
    _compare_summed_grads(model, ref, rank)

    with pytest.raises(UlyssesError, match="labels with slice_inputs=True"):
        model(input_ids=row, position_ids=pos, labels=row, **kw_row)
    if not vision:
        other = row if rank == 0 else row.flip(-1)
        with pytest.raises(UlyssesError, match="passed different rows"):
            model(input_ids=other, position_ids=pos)
    plain = tiny_model(name)
    tfcompat.patch(plain, ulysses_group=dist.group.WORLD)
    with pytest.raises(UlyssesError, match="slice_inputs=True"):
        plain(input_ids=row, position_ids=pos, **kw_row)
    if not vision and VERL is not None:
        # verl's text path: its own ulysses_pad_and_slice_inputs gives each rank its slice (of verl's group:
        # unset, every rank would take rank 0's slice, which the patched model refuses as a whole row)
        VERL.set_ulysses_sequence_parallel_group(dist.group.WORLD)
        ids_local, pos_local, pad = VERL.ulysses_pad_and_slice_inputs(pk.input_ids, pk.position_ids, sp_size=world)
        plain.train()
        local = plain(input_ids=ids_local, position_ids=pos_local).logits
        got = VERL.gather_outputs_and_unpad(local, gather_dim=1, unpad_dim=1, padding_size=pad, grad_scaler=False,
                                            group=dist.group.WORLD)
        close_to_model(got.detach(), want.detach(), f"rank {rank} logits (verl's slicing)")


@pytest.mark.parametrize("how", ["ulysses", "whole_row"])
@pytest.mark.parametrize("name", ["qwen2", "qwen2_vl", "qwen3_vl"])
def test_generate_with_the_policy_being_trained(outcomes, name, how):
    """An RL rollout on the Ulysses-patched policy: each rank's own prompts decode as the unpatched model's."""
    if name not in HAVE:
        pytest.skip("not in this release")
    assert_ok(outcomes, f"generate_{how}:{name}")


@pytest.mark.parametrize("name", ["qwen2", "qwen2_vl", "qwen3_vl"])
def test_whole_row_call_slices_after_embedding(outcomes, name):
    """verl's VLM Ulysses call, with verl's own ulysses_pad / gather_outputs_and_unpad where verl is installed."""
    if name not in HAVE:
        pytest.skip("not in this release")
    assert_ok(outcomes, f"whole_row:{name}")
