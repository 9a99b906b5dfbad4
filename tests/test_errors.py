"""Bad input gets the documented tfcompat error, with a message that says what to do."""

import pytest
import torch

from tfcompat._probe import resolve as _resolve  # private: the resolutions themselves are under test
from tfcompat.config import rope_parameters
from tfcompat.errors import ConfigError, RopeShapeError, TfcompatError, UnsupportedTransformersError
from tfcompat.rope import apply_rope
from tfcompat.testing import families, tiny_config
from tfcompat.version import transformers_version

from _helpers import installed, position_ids, rotary, rotary_families

SPECS = families(installed_only=False)  # the family facts, from the public face

FAMILIES = rotary_families()


def _cos(name, batch=1, seq=5):
    rot, config = rotary(name)
    cos, sin = rot(torch.zeros(1), position_ids(name, batch, seq, torch.Generator().manual_seed(0)))
    head_dim = rope_parameters(config).head_dim
    return config, cos, sin, torch.randn(batch, 2, seq, head_dim), torch.randn(batch, 1, seq, head_dim)


def test_error_family():
    assert issubclass(UnsupportedTransformersError, ImportError)
    assert issubclass(RopeShapeError, ValueError) and issubclass(ConfigError, ValueError)
    assert all(issubclass(e, TfcompatError) for e in (UnsupportedTransformersError, RopeShapeError, ConfigError))


def test_unknown_model_type():
    q = torch.zeros(1, 1, 1, 8)
    with pytest.raises(UnsupportedTransformersError,
                       match=r"does not cover model_type 'gpt2'; supported families: .*glm4v"):
        apply_rope(q, q, torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), model_type="gpt2")


@pytest.mark.parametrize("name", FAMILIES)
def test_wrong_cos_layout_for_this_release(name):
    config, cos, sin, q, k = _cos(name)
    rows = _resolve.resolve("rope.apply", name).plan.cos_rows
    wrong_cos, wrong_sin = (cos[0], sin[0]) if rows == 3 else (cos.expand(3, *cos.shape), sin.expand(3, *sin.shape))
    expected = r"\(3, batch, seq, dim\)" if rows == 3 else r"\(batch, seq, dim\)"
    with pytest.raises(RopeShapeError, match=rf"apply_rope for {name}: cos has shape .* but transformers "
                                             rf"{transformers_version()} returns {expected}"):
        apply_rope(q, k, wrong_cos, wrong_sin, config=config)


@pytest.mark.parametrize("name", FAMILIES)
def test_q_that_does_not_fit_cos(name):
    config, cos, sin, q, k = _cos(name, seq=5)
    with pytest.raises(RopeShapeError, match="q has shape"):
        apply_rope(q[:, :, :4], k, cos, sin, config=config)
    with pytest.raises(RopeShapeError, match="does not broadcast to q"):
        apply_rope(q[0], k, cos, sin, config=config)


@pytest.mark.parametrize("name", [n for n in FAMILIES if SPECS[n].mrope == "contiguous"])
def test_sections_that_do_not_add_up(name):
    config, cos, sin, q, k = _cos(name)
    if _resolve.resolve("rope.apply", name).plan.cos_rows == 3:
        with pytest.raises(RopeShapeError, match=r"mrope_section \[1, 1, 1\] must add up to half"):
            apply_rope(q, k, cos, sin, model_type=name, mrope_section=(1, 1, 1))
        with pytest.raises(RopeShapeError, match="the mRoPE sections are needed; pass config= or mrope_section="):
            apply_rope(q, k, cos, sin, model_type=name)
    bad = tiny_config(name)
    from tfcompat.config import text_config

    tc = text_config(bad)
    rope = tc.__dict__.get("rope_parameters") or tc.__dict__.get("rope_scaling")
    rope["mrope_section"] = [1, 1, 1]
    with pytest.raises(ConfigError, match=r"mrope_section \[1, 1, 1\] adds up to 3, but the rotary width is"):
        rope_parameters(bad)


def test_family_missing_from_this_release_names_the_version():
    missing = [n for n in SPECS if n not in installed()]
    if not missing:
        pytest.skip("every family ships with this release")
    with pytest.raises(UnsupportedTransformersError,
                       match=rf"transformers {transformers_version()} has no .*first ships"):
        _resolve.resolve("rope.apply", missing[0])


def test_config_without_model_type():
    with pytest.raises(UnsupportedTransformersError, match="pass model_type="):
        rope_parameters(object())


@pytest.mark.parametrize("how", ["list", "meta"])
def test_cu_seq_lens_as_a_list_or_on_meta_are_refused_by_name(how):
    """Boundaries given as a list, or on the meta device, to both cu_seq_lens_q and _k: a PackingError naming
    the key (they reached a raw `.cpu()` before the type check: AttributeError / NotImplementedError)."""
    import tfcompat
    from tfcompat.errors import PackingError
    from tfcompat.testing import tiny_model

    model = tiny_model("qwen2")
    tfcompat.patch(model)
    cu = [0, 3, 8] if how == "list" else torch.tensor([0, 3, 8], device="meta")
    with pytest.raises(PackingError, match="cu_seq_lens_q is " + ("a list" if how == "list" else "on the meta")):
        model(input_ids=torch.randint(1, 50, (1, 8)), cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=5,
              max_length_k=5)


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen3_vl"])
def test_one_sequence_cu_beside_restarting_mrope_ids_is_refused(name):
    """cu_seq_lens = [0, n] beside 3-row mRoPE ids that restart at (0, 0, 0) mid-row: RoPE and attention would
    disagree about where sequences begin; refused as the same contradiction with 2-D or 4-row ids is (it ran as
    one sequence). Boundaries that agree with the ids run."""
    import tfcompat
    from tfcompat.errors import PackingError
    from tfcompat.testing import tiny_model

    if name not in installed():
        pytest.skip("not in this release")
    model = tiny_model(name)
    tfcompat.patch(model)
    ids = torch.randint(1, 50, (1, 8))
    pos = torch.cat([torch.arange(5), torch.arange(3)])[None].expand(3, 1, 8).clone()
    one = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(PackingError, match=r"restart at \(0, 0, 0\) at \[0, 5\]"):
        model(input_ids=ids, position_ids=pos, cu_seq_lens_q=one, cu_seq_lens_k=one, max_length_q=8, max_length_k=8)
    two = torch.tensor([0, 5, 8], dtype=torch.int32)
    out = model(input_ids=ids, position_ids=pos, cu_seq_lens_q=two, cu_seq_lens_k=two, max_length_q=5,
                max_length_k=5)
    assert out.logits.shape[:2] == (1, 8)


def test_a_packed_row_with_a_cache_is_one_packing_error():
    """A packed row with a KV cache is refused with one class (PackedCacheError: a PackingError and a UlyssesError,
    the class it had under a sequence group) whether the boundaries come from position ids or cu_seq_lens_q;
    output_attentions on a packed row is a PackingError."""
    from transformers import DynamicCache

    import tfcompat
    from tfcompat.errors import PackedCacheError, PackingError, UlyssesError
    from tfcompat.packing import pack
    from tfcompat.testing import padded_batch, tiny_model

    model = tiny_model("qwen2")
    tfcompat.patch(model)
    ids, mask = padded_batch([[5, 6, 7, 8], [9, 10, 11]])
    pk = pack(ids, mask)
    try:
        cache = DynamicCache(config=model.config)
    except TypeError:
        cache = DynamicCache()
    for extra in ({}, {"cu_seq_lens_q": pk.cu_seqlens, "max_length_q": pk.max_seqlen}):
        with torch.no_grad(), pytest.raises(PackedCacheError, match="KV cache") as err:
            model(input_ids=pk.input_ids, position_ids=pk.position_ids, past_key_values=cache, use_cache=True,
                  **extra)
        assert isinstance(err.value, PackingError) and isinstance(err.value, UlyssesError)
    with torch.no_grad(), pytest.raises(PackingError, match="output_attentions=True"):
        model(input_ids=pk.input_ids, position_ids=pk.position_ids, output_attentions=True, use_cache=False)
