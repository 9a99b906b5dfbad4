"""Tiny models and batches for the patch / embeds tests (oracle: the unpatched upstream model)."""

import inspect

import torch

from tfcompat._probe.families import family
from tfcompat.embeds import mm_token_type_ids, rope_index
from tfcompat.testing import padded_batch, tiny_model, tiny_pixels, tiny_sequence

PAD = 0  # the id padded_batch pads with
padded = padded_batch


def forward_kwargs(model, ids, **extra):
    """Add mm_token_type_ids where this release's forward takes it (required with pixels from 5.3)."""
    kw = dict(extra)
    params = inspect.signature(type(model).forward).parameters
    if family(model.config).vision and "mm_token_type_ids" in params:
        kw["mm_token_type_ids"] = mm_token_type_ids(model, ids)
    if "video_second_per_grid" in params and kw.get("video_grid_thw") is not None:
        kw["video_second_per_grid"] = seconds(kw["video_grid_thw"])  # omni thinkers: no default for videos
    return kw


def seconds(video_grid_thw):
    """Seconds per temporal patch of each tiny video (what a processor returns as video_second_per_grid)."""
    return torch.ones(video_grid_thw.shape[0])


def video_seconds(model, video_grid_thw):
    """rope_index's second_per_grid_ts where the family's get_rope_index has no default for videos (the omni
    thinkers); nothing elsewhere (5.3's Qwen2.5-VL get_rope_index runs out of them: upstream bug)."""
    if video_grid_thw is None:
        return {}
    owner = getattr(model, "model", None)
    fn = getattr(owner, "get_rope_index", None) or model.get_rope_index
    return {"second_per_grid_ts": seconds(video_grid_thw)} if "second_per_grids" in inspect.signature(fn).parameters \
        else {}


def text_model(model):
    for m in model.modules():
        if "layers" in m._modules and "embed_tokens" in m._modules:
            return m
    raise AssertionError("no text model")


def capture_text_model_inputs(model, **kwargs):
    """Run the model and return the keyword arguments its text decoder stack received."""
    box = {}
    hook = text_model(model).register_forward_pre_hook(lambda m, a, k: box.update(k), with_kwargs=True)
    try:
        model(use_cache=False, **kwargs)
    finally:
        hook.remove()
    return box


def three_d_positions(model, ids, mask, pixels):
    if not family(model.config).vision:
        return None
    videos = pixels.get("video_grid_thw")
    pos, _ = rope_index(model, ids, image_grid_thw=pixels.get("image_grid_thw"), video_grid_thw=videos,
                        attention_mask=mask, **video_seconds(model, videos))
    return pos


__all__ = ["run_upstream", "padded", "forward_kwargs", "seconds", "video_seconds", "capture_text_model_inputs",
           "three_d_positions", "tiny_model", "tiny_pixels", "tiny_sequence", "text_model"]


#: upstream forwards known to be broken on some releases: (exception, message fragment or "", first and last
#: release, why). The oracle test is skipped with the reason there; tfcompat's own paths still run.
UPSTREAM_BUGS = (
    (StopIteration, "", "5.3.0", "5.5.3",
     "this release's Qwen3-VL/Qwen3.5 forward cannot position multi-frame videos (upstream bug in "
     "get_rope_index; tfcompat.embeds.rope_index splits the grid per frame)"),
    (ValueError, "Video features and video tokens do not match", "4.54.0", "4.54.1",
     "transformers 4.54.x Qwen2-VL counts video tokens with image_token_id (upstream bug; tfcompat.embeds is "
     "not affected)"),
    (ValueError, "too many values to unpack", "5.0.0", "5.2.99",
     "transformers 5.0 Qwen3-Omni thinker unpacks get_video_features(...).pooler_output into two values and "
     "cannot take videos (upstream bug)"),
    (RuntimeError, "Class values must be smaller than num_classes", "5.0.0", "5.2.99",
     "this release's Qwen3-Next router loss (output_router_logits, which TRL's SFTTrainer turns on) one-hot "
     "encodes expert indices beyond num_experts on the unpatched padded batch (upstream bug)"),
    (RuntimeError, "cannot be broadcast to indexing result", "4.57.0", "4.57.99",
     "transformers 4.57 Qwen3-Omni thinker hands its text model a (batch, seq, hidden) visual mask, which its "
     "deepstack merge cannot index (upstream bug)"),
    (AttributeError, "object has no attribute 'vocab_size'", "4.52.0", "4.55.99",
     "transformers 4.52-4.55 VL models compute their loss from config.vocab_size, which the top-level VL config "
     "lacks: the unpatched model cannot take labels (upstream bug)"),
)


def run_upstream(fn):
    """Run the upstream oracle; skip where this release's own forward is known to be broken (UPSTREAM_BUGS)."""
    import pytest

    from tfcompat.version import is_transformers_version_in_range

    try:
        return fn()
    except (StopIteration, ValueError, RuntimeError, AttributeError) as exc:
        for kind, fragment, first, last, why in UPSTREAM_BUGS:
            if isinstance(exc, kind) and fragment in str(exc) and is_transformers_version_in_range(first, last):
                pytest.skip(why)
        raise


def split_vision_hidden(name, rows, patch_kwargs, split_kwargs, image_on_every_rank=False):
    """A packed VL row (positions from rope_index): the text model's hidden states of the single-process patched
    model (``want``) and of a model patched with ``patch_kwargs`` whose text model runs on this rank's share of
    the full row's embeddings (``tfcompat.ulysses.slice_inputs(..., **split_kwargs)``; Qwen3-VL's vision rows
    too), gathered back (``got``). Both backward with the same random weights. Returns (got, want, model, ref).
    ``image_on_every_rank``: assert that this rank holds some of the 4 image tokens, not all."""
    import tfcompat
    from tfcompat.embeds import get_input_embeds
    from tfcompat.packing import pack
    from tfcompat.ulysses import gather_from_ranks, slice_inputs

    ids, mask = padded(rows)
    pixels = tiny_pixels(1)

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
    want = text_model(ref)(inputs_embeds=embeds, position_ids=pk.position_ids, use_cache=False, **extra)[0]
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    (want * weights).sum().backward()
    model = tiny_model(name)
    tfcompat.patch(model, **patch_kwargs)
    _, embeds, extra = embeddings(model)
    local = slice_inputs(embeds, pk.position_ids, **split_kwargs, **extra)
    if image_on_every_rank and "visual_pos_masks" in local:
        assert 0 < int(local["visual_pos_masks"].sum()) < 4, "the test must split the image across ranks"
    hidden = text_model(model)(use_cache=False, **local)[0]
    got = gather_from_ranks(hidden, dim=1, length=pk.input_ids.shape[1], **split_kwargs)
    (got * weights).sum().backward()
    return got.detach(), want.detach(), model, ref


def generate_on_this_rank(name, rank, patch_kwargs):
    """generate() with a sequence-parallel-patched policy (an RL rollout with the policy being trained): this
    rank's own prompts (they differ between ranks; an image for vision families) decode to the unpatched
    model's tokens and logits; nothing is split."""
    import tfcompat

    vision = family(name).vision
    ids = torch.tensor([tiny_sequence(name, text=4 + rank, image=vision)] * 2)
    kw = dict(max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True)
    plain = tiny_model(name)
    extra = forward_kwargs(plain, ids, **tiny_pixels(2 if vision else 0, seed=rank))
    want = plain.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **extra, **kw)
    model = tiny_model(name)
    tfcompat.patch(model, **patch_kwargs)
    got = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **extra, **kw)
    assert torch.equal(got.sequences, want.sequences), (got.sequences, want.sequences)
    for g, w in zip(got.logits, want.logits):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    # a packed row with a cache is not a generation step: refused, not handed to upstream unsplit
    import pytest

    from tfcompat.errors import UlyssesError

    row = torch.tensor([tiny_sequence(name, text=3) + tiny_sequence(name, text=4)])
    pos = torch.cat((torch.arange(len(tiny_sequence(name, text=3))), torch.arange(len(tiny_sequence(name, text=4)))))
    with pytest.raises(UlyssesError, match="packed row"):
        model(input_ids=row, position_ids=pos[None], past_key_values=_dynamic_cache(model))


def _dynamic_cache(model):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # 4.x: no config argument
        return DynamicCache()


def word_tokenizer():
    """A tokenizer built here (nothing is downloaded): one word per id of the tiny models' vocabulary (TRL's
    SFTTrainer needs a processing class)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(256)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t1")), pad_token="t0",
                                   eos_token="t2")
