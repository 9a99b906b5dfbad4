"""Ulysses sequence parallelism and the dummy visual forward under DDP, over gloo with 2 processes."""

import pytest
import torch
import torch.distributed as dist

import tfcompat
from tfcompat._families import FAMILIES as SPECS
from tfcompat.embeds import get_input_embeds, rope_index
from tfcompat.packing import pack
from tfcompat.ulysses import UlyssesError, gather_from_ranks, slice_for_rank

from _dist import spawn
from _helpers import installed
from _models import padded, text_model, tiny_model, tiny_pixels, tiny_sequence

HAVE = installed()


def _close(got, want, what):
    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=3e-5 * scale, msg=lambda m: f"{what}: {m}")


def _ulysses_worker(rank, world, name, kv_heads):
    rows = [tiny_sequence(name, text=7), tiny_sequence(name, text=4)]
    ids, mask = padded(rows)
    pk = pack(ids, mask, vision=SPECS[name].vision)
    total = pk.input_ids.shape[1]
    weights = torch.randn(1, total, 256, generator=torch.Generator().manual_seed(3))

    ref = tiny_model(name, num_key_value_heads=kv_heads)
    tfcompat.patch(ref)
    want = ref(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False).logits
    (want * weights).sum().backward()

    model = tiny_model(name, num_key_value_heads=kv_heads)
    record = tfcompat.patch(model, ulysses_group=dist.group.WORLD)
    assert record.ulysses_world_size == world
    local_ids = slice_for_rank(pk.input_ids, dim=1)
    local_pos = slice_for_rank(pk.position_ids, dim=pk.position_ids.dim() - 1)
    local = model(input_ids=local_ids, position_ids=local_pos, use_cache=False).logits
    got = gather_from_ranks(local, dim=1, length=total)
    (got * weights).sum().backward()
    _close(got.detach(), want.detach(), f"rank {rank} logits")
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if q.grad is None:  # the vision tower of a text-only batch
            assert p.grad is None, n
            continue
        grad = p.grad.clone()
        dist.all_reduce(grad)  # each rank holds the gradient of its own tokens
        _close(grad, q.grad, f"rank {rank} grad {n}")


@pytest.mark.parametrize("name,kv_heads", [("qwen2", 2), ("qwen2_vl", 1), ("glm4v", 2), ("qwen3_vl", 1)])
def test_ulysses_equals_single_process(name, kv_heads):
    """World 2; kv_heads=1 checks a group larger than the kv head count."""
    if name not in HAVE:
        pytest.skip("not in this release")
    spawn(_ulysses_worker, 2, name, kv_heads)


def _bad_heads_worker(rank, world):
    model = tiny_model("qwen2", num_attention_heads=3, num_key_value_heads=1, head_dim=32)
    with pytest.raises(UlyssesError, match="3 attention heads of qwen2 do not divide over 2 ranks"):
        tfcompat.patch(model, ulysses_group=dist.group.WORLD)


def test_ulysses_refuses_heads_that_do_not_divide():
    spawn(_bad_heads_worker, 2)


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
    for n, p in model.named_parameters():
        t = p.detach()
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        lo, hi = t.clone(), t.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        assert torch.equal(lo, hi), f"{n} differs across ranks"
    moved = [n for n, v in before.items() if not torch.equal(v, dict(model.named_parameters())[n].detach())]
    if mode == "ddp":
        assert moved, "vision weights never moved: rank 0's image gradients did not reach the update"


@pytest.mark.parametrize("name", ["qwen2_vl", "glm4v", "qwen3_vl"])
def test_ddp_with_a_text_only_rank(name):
    if name not in HAVE:
        pytest.skip("not in this release")
    spawn(_ddp_worker, 2, name, "ddp")


def test_fsdp_with_a_text_only_rank():
    pytest.importorskip("torch.distributed.fsdp")
    from torch.distributed import fsdp

    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no FSDP2 fully_shard")
    spawn(_ddp_worker, 2, "qwen2_vl", "fsdp")


def _ulysses_vision_worker(rank, world, name):
    from tfcompat.ulysses import slice_inputs

    from _models import tiny_pixels as pixels_for

    # the image tokens of the second sequence straddle the two ranks' slices
    rows = [tiny_sequence(name, text=4), tiny_sequence(name, text=5, image=True)]
    ids, mask = padded(rows)
    pixels = pixels_for(1)

    def embeddings(model):
        pos3, _ = rope_index(model, ids, image_grid_thw=pixels["image_grid_thw"], attention_mask=mask)
        pk = pack(ids, mask, pos3)
        res = get_input_embeds(model, pk.input_ids, **pixels)
        extra = {}
        if res.deepstack_visual_embeds is not None:
            extra = dict(visual_pos_masks=res.visual_pos_masks, deepstack_visual_embeds=res.deepstack_visual_embeds)
        return pk, res.inputs_embeds, extra

    ref = tiny_model(name)
    tfcompat.patch(ref)
    pk, embeds, extra = embeddings(ref)
    total = pk.input_ids.shape[1]
    want = text_model(ref)(inputs_embeds=embeds, position_ids=pk.position_ids, use_cache=False, **extra)[0]
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    (want * weights).sum().backward()

    model = tiny_model(name)
    tfcompat.patch(model, ulysses_group=dist.group.WORLD)
    _, embeds, extra = embeddings(model)
    local = slice_inputs(embeds, pk.position_ids, **extra)
    if "visual_pos_masks" in local:
        assert 0 < int(local["visual_pos_masks"].sum()) < 4, "the test must split the image across ranks"
    hidden = text_model(model)(use_cache=False, **local)[0]
    got = gather_from_ranks(hidden, dim=1, length=total)
    (got * weights).sum().backward()
    _close(got.detach(), want.detach(), f"rank {rank} hidden")
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if q.grad is None:
            continue
        grad = p.grad.clone()
        dist.all_reduce(grad)
        _close(grad, q.grad, f"rank {rank} grad {n}")


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen3_vl"])
def test_ulysses_with_images_and_deepstack(name):
    """Embeddings on the full row, then each rank keeps its slice (Qwen3-VL: of the deepstack rows too)."""
    if name not in HAVE:
        pytest.skip("not in this release")
    spawn(_ulysses_vision_worker, 2, name)
