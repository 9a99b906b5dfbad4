"""get_input_embeds / rope_index against the installed model's own embedding path."""

import re

import pytest
import torch

from tfcompat._probe.families import FAMILIES as SPECS  # private: probe-only facts the public FamilyInfo leaves out
from tfcompat.embeds import (
    EmbedsError,
    dummy_visual_zero,
    get_input_embeds,
    mm_token_type_ids,
    rope_index,
    unpack_visual_output,
)

from _helpers import installed
from _models import (
    capture_text_model_inputs,
    forward_kwargs,
    padded,
    run_upstream,
    three_d_positions,
    tiny_model,
    tiny_pixels,
    tiny_sequence,
    video_seconds,
)

VISION = [n for n in installed() if SPECS[n].vision and not SPECS[n].embeds_refusal]
CASES = {"image": (1, 0), "video": (0, 1), "both": (1, 1), "neither": (0, 0)}


def _batch(name, images, videos):
    ids = torch.tensor([tiny_sequence(name, text=5, image=bool(images), video=bool(videos))])
    return ids, tiny_pixels(images, videos)


@pytest.mark.parametrize("name", VISION)
@pytest.mark.parametrize("case", list(CASES))
def test_get_input_embeds_equals_the_model_forward(name, case):
    images, videos = CASES[case]
    if case == "both" and SPECS[name].video_frames_as_image_tokens:
        pytest.skip("GLM-4V's own forward cannot take images and videos together (same placeholder token)")
    model = tiny_model(name)
    ids, pixels = _batch(name, images, videos)
    seen = run_upstream(lambda: capture_text_model_inputs(model, input_ids=ids, attention_mask=torch.ones_like(ids),
                                                          **forward_kwargs(model, ids, **pixels)))
    got = get_input_embeds(model, ids, **pixels)
    assert torch.equal(got.inputs_embeds, seen["inputs_embeds"])
    assert got.used_dummy == (case == "neither")
    if seen.get("deepstack_visual_embeds") is not None:
        want_mask = seen["visual_pos_masks"]
        if want_mask.dim() == 3:  # 4.57 Qwen3-Omni hands its text model the mask expanded over the hidden size
            want_mask = want_mask.any(-1)
        assert torch.equal(got.visual_pos_masks, want_mask)
        assert len(got.deepstack_visual_embeds) == len(seen["deepstack_visual_embeds"])
        for a, b in zip(got.deepstack_visual_embeds, seen["deepstack_visual_embeds"]):
            assert torch.equal(a, b)
    else:
        assert got.deepstack_visual_embeds is None
    vgrid = pixels.get("video_grid_thw")
    pos, deltas = rope_index(model, ids, image_grid_thw=pixels.get("image_grid_thw"), video_grid_thw=vgrid,
                             attention_mask=torch.ones_like(ids), **video_seconds(model, vgrid))
    assert pos.shape == (3, 1, ids.shape[1])
    if seen.get("position_ids") is not None:
        assert torch.equal(seen["position_ids"][-3:], pos)
    if images or videos:
        assert not torch.equal(pos[0], pos[1]), "vision tokens must get 3-D positions"


@pytest.mark.parametrize("name", VISION)
def test_dummy_visual_forward_backward(name):
    """Text-only batch: every vision weight gets a zero gradient; no in-place op on autograd tensors."""
    model = tiny_model(name)
    model.train()
    ids, _ = _batch(name, 0, 0)
    with torch.autograd.set_detect_anomaly(True):
        res = get_input_embeds(model, ids)
        assert res.used_dummy
        assert torch.equal(res.inputs_embeds, model.get_input_embeddings()(ids))
        pos, _ = rope_index(model, ids)  # 4.x forwards cannot derive positions from inputs_embeds alone
        out = model(inputs_embeds=res.inputs_embeds, position_ids=pos, attention_mask=torch.ones_like(ids),
                    use_cache=False).logits
        out.float().pow(2).mean().backward()
    visual = [(n, p) for n, p in model.named_parameters() if ".visual." in f".{n}" or n.startswith("visual.")]
    assert visual
    for n, p in visual:
        assert p.grad is not None, f"{n} got no gradient"
        assert torch.count_nonzero(p.grad) == 0, f"{n} got a non-zero gradient"
    text = [p for n, p in model.named_parameters() if "embed_tokens" in n]
    assert text and text[0].grad is not None and text[0].grad.abs().sum() > 0


@pytest.mark.parametrize("name", VISION[:3])
def test_bad_vision_inputs(name):
    model = tiny_model(name)
    ids, pixels = _batch(name, 1, 0)
    cfg = model.config
    short = ids[ids != cfg.image_token_id].tolist()
    short = torch.tensor([short[:3] + [cfg.image_token_id] * 3 + short[3:]])
    with pytest.raises(EmbedsError, match=r"input_ids hold 3 image tokens but the vision tower returned 4 image"):
        get_input_embeds(model, short, **pixels)
    with pytest.raises(EmbedsError,
                       match=r"image_grid_thw describes 64 patches \(\[\[1, 8, 8\]\]\) but pixel_values has 16 rows"):
        get_input_embeds(model, ids, pixel_values=pixels["pixel_values"], image_grid_thw=torch.tensor([[1, 8, 8]]))
    with pytest.raises(EmbedsError, match="hold 4 image tokens but no pixel_values"):
        get_input_embeds(model, ids)


def test_unpack_visual_output_shapes():
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    a, b = torch.randn(4, 8), torch.randn(2, 8)
    assert unpack_visual_output(a)[0] is a and unpack_visual_output(a)[1] is None
    e, d = unpack_visual_output((a, [b, b]))
    assert e is a and len(d) == 2
    e, d = unpack_visual_output(((a, b), [(b, b)]))
    assert e.shape == (6, 8) and d[0].shape == (4, 8)
    e, d = unpack_visual_output((a, b))
    assert e.shape == (6, 8) and d is None
    e, d = unpack_visual_output(BaseModelOutputWithPooling(last_hidden_state=a, pooler_output=(a, b)))
    assert e.shape == (6, 8) and d is None
    with pytest.raises(EmbedsError, match="cannot read dict"):
        unpack_visual_output({"x": a})


@pytest.mark.parametrize("name", [n for n in VISION if SPECS[n].video_block_per_frame])
def test_rope_index_of_multi_frame_videos(name):
    """Qwen3-VL/Qwen3.5: a (2, h, w) video grid positions like two (1, h, w) frames, on every release."""
    model = tiny_model(name)
    ids, pixels = _batch(name, 0, 1)
    whole, _ = rope_index(model, ids, video_grid_thw=pixels["video_grid_thw"])
    frames, _ = rope_index(model, ids, video_grid_thw=torch.tensor([[1, 4, 4], [1, 4, 4]]))
    assert torch.equal(whole, frames)
    video = ids[0] == model.config.video_token_id
    assert whole[1, 0][video].tolist() != whole[0, 0][video].tolist(), "video tokens must get 3-D positions"


def _vl_batch(name, left):
    rows = [tiny_sequence(name, text=5, image=True, video=True), tiny_sequence(name, text=3),
            tiny_sequence(name, text=4, image=True, image_first=True)]
    from _models import padded

    ids, mask = padded(rows)
    if left:  # left padding: roll each row's padding to the front
        for i in range(ids.shape[0]):
            n = int(mask[i].sum())
            ids[i] = torch.roll(ids[i], ids.shape[1] - n)
            mask[i] = torch.roll(mask[i], ids.shape[1] - n)
    pixels = tiny_pixels(images=2, videos=1)
    return ids, mask, pixels


@pytest.mark.parametrize("name", VISION)
@pytest.mark.parametrize("left", [False, True], ids=["right_pad", "left_pad"])
def test_rope_index_from_a_config_equals_the_models_forward(name, left):
    """A data-loading worker holds a config, not a model: same ids as the model's own forward computes."""
    if SPECS[name].video_frames_as_image_tokens:
        pytest.skip("GLM-4V's own forward cannot take images and videos together (same placeholder token)")
    model = tiny_model(name)
    ids, mask, pixels = _vl_batch(name, left)
    seen = run_upstream(lambda: capture_text_model_inputs(model, input_ids=ids, attention_mask=mask,
                                                           **forward_kwargs(model, ids, **pixels)))
    grids = dict(image_grid_thw=pixels["image_grid_thw"], video_grid_thw=pixels["video_grid_thw"],
                 **video_seconds(model, pixels["video_grid_thw"]))
    got, deltas = rope_index(model.config, ids, attention_mask=mask, **grids)
    mine, my_deltas = rope_index(model, ids, attention_mask=mask, **grids)
    assert torch.equal(got, mine) and torch.equal(deltas, my_deltas)
    want = seen["position_ids"][-3:]
    valid = mask.bool()
    assert torch.equal(got[:, valid], want[:, valid])


@pytest.mark.parametrize("name", [n for n in VISION if SPECS[n].video_frames_as_image_tokens])
def test_rope_index_from_a_config_glm_video_frames(name):
    model = tiny_model(name)
    ids = torch.tensor([tiny_sequence(name, text=5, video=True)])
    grid = tiny_pixels(videos=1)["video_grid_thw"]
    got, _ = rope_index(model.config, ids, video_grid_thw=grid)
    seen = run_upstream(lambda: capture_text_model_inputs(model, input_ids=ids, attention_mask=torch.ones_like(ids),
                                                           **forward_kwargs(model, ids, **tiny_pixels(videos=1))))
    assert torch.equal(got, seen["position_ids"][-3:])


def test_rope_index_from_a_config_seconds_per_grid():
    name = "qwen2_5_vl"
    if name not in VISION:
        pytest.skip("not in this release")
    model = tiny_model(name)
    ids = torch.tensor([tiny_sequence(name, text=5, video=True)])
    grid = tiny_pixels(videos=1)["video_grid_thw"]
    a, _ = rope_index(model.config, ids, video_grid_thw=grid, second_per_grid_ts=torch.tensor([1.0]))
    b, _ = rope_index(model.config, ids, video_grid_thw=grid, second_per_grid_ts=torch.tensor([4.0]))
    want, _ = rope_index(model, ids, video_grid_thw=grid, second_per_grid_ts=torch.tensor([4.0]))
    assert torch.equal(b, want) and not torch.equal(a, b), "seconds per grid must move the temporal positions"


@pytest.mark.parametrize("name", VISION)
def test_rope_index_refuses_what_does_not_fit(name):
    config = tiny_model(name).config
    ids = torch.tensor([tiny_sequence(name, text=5, image=True)])
    grid = tiny_pixels(images=1)["image_grid_thw"]
    with pytest.raises(EmbedsError, match="image tokens but no image_grid_thw"):
        rope_index(config, ids)
    with pytest.raises(EmbedsError, match="describes 8"):
        rope_index(config, ids, image_grid_thw=torch.tensor([[2, 4, 4]]))
    with pytest.raises(EmbedsError, match="must have input_ids' shape"):
        rope_index(config, ids, image_grid_thw=grid, mm_token_type_ids=torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(EmbedsError, match="positive integer"):
        rope_index(config, ids, image_grid_thw=grid.float())
    with pytest.raises(EmbedsError, match="not divisible"):
        rope_index(config, ids, image_grid_thw=torch.tensor([[1, 3, 4]]))


@pytest.mark.parametrize("name", VISION)
def test_pack_requires_mrope_positions_for_vision_tokens(name):
    from tfcompat.errors import PackingError
    from tfcompat.packing import pack

    from _models import padded

    config = tiny_model(name).config
    ids, mask = padded([tiny_sequence(name, text=4, image=True), tiny_sequence(name, text=3)])
    with pytest.raises(PackingError, match="need the 3-D mRoPE positions"):
        pack(ids, mask, config=config)
    text = (mask.cumsum(-1) - 1).clamp(min=0)
    with pytest.raises(PackingError, match="text positions"):
        pack(ids, mask, text.unsqueeze(0).expand(3, -1, -1), config=config)
    pos, _ = rope_index(config, ids, attention_mask=mask, image_grid_thw=tiny_pixels(images=1)["image_grid_thw"])
    packed_batch = pack(ids, mask, pos, config=config)
    assert packed_batch.position_ids.shape == (4, 1, int(mask.sum()))
    text_only, text_mask = padded([tiny_sequence(name, text=4)])
    assert pack(text_only, text_mask, config=config).position_ids.shape[0] == 1


@pytest.mark.parametrize("name", [n for n in installed() if SPECS[n].embeds_refusal])
def test_families_embeds_cannot_serve_are_refused_by_name(name):
    model = tiny_model(name)
    ids = torch.tensor([[10, 11, 12]])
    calls = {"get_input_embeds": lambda: get_input_embeds(model, ids), "rope_index": lambda: rope_index(model, ids),
             "rope_index from a config": lambda: rope_index(model.config, ids),
             "mm_token_type_ids": lambda: mm_token_type_ids(model.config, ids),
             "dummy_visual_zero": lambda: dummy_visual_zero(model)}
    for call in calls.values():
        with pytest.raises(EmbedsError, match=f"does not serve {name}: {re.escape(SPECS[name].embeds_refusal)}"):
            call()


@pytest.mark.parametrize("name", [n for n in VISION if SPECS[n].mrope])
def test_upstreams_mrope_positions_start_a_sequence_only_at_the_origin(name):
    """The rule tfcompat reads 3-row mRoPE ids by (``_attention.starts.at_origin``, eagerly and traced alike):
    upstream's get_rope_index (the release's own, through tfcompat.embeds.rope_index) puts each sequence's first
    token at (0, 0, 0) and no other token of it there, whether the sequence starts with an image, holds one inside,
    or none. The packed row of three sequences is marked at exactly their starts."""
    from tfcompat._attention.starts import at_origin  # private: the one reading of 3-row ids is under test

    model = tiny_model(name)
    rows = [tiny_sequence(name, image=True, config=model.config), tiny_sequence(name, text=5, config=model.config),
            tiny_sequence(name, image=True, image_first=True, config=model.config)]
    ids, mask = padded(rows)
    pos = three_d_positions(model, ids, mask, tiny_pixels(images=2))
    row = torch.cat([pos[:, i, mask[i].bool()] for i in range(len(rows))], dim=1)  # (3, tokens): the packed row
    want = torch.zeros(row.shape[1], dtype=torch.bool)
    want[[0, len(rows[0]), len(rows[0]) + len(rows[1])]] = True
    assert torch.equal(at_origin(row), want), (row.tolist(), [len(r) for r in rows])
