"""rope_parameters against what the installed rotary module actually uses."""

import copy

import pytest
import torch

from tfcompat._families import FAMILIES as SPECS
from tfcompat.config import rope_parameters, text_config
from tfcompat.testing import TINY_SECTIONS, tiny_config

from _helpers import rotary, rotary_families

FAMILIES = rotary_families()


@pytest.mark.parametrize("name", FAMILIES)
def test_matches_upstream_rotary_module(name):
    rot, config = rotary(name)
    rp = rope_parameters(config)
    assert rp.model_type == (SPECS[name].text_family or name)  # the decoder described
    assert rp.rope_type == "default"
    assert rp.rotary_dim == 2 * rot.inv_freq.numel()
    want = 1.0 / (rp.rope_theta ** (torch.arange(0, rp.rotary_dim, 2, dtype=torch.float) / rp.rotary_dim))
    torch.testing.assert_close(rot.inv_freq.float(), want)
    if getattr(rot, "mrope_section", None) is not None:
        assert rp.mrope_section == tuple(rot.mrope_section)
    assert rp.mrope_section == TINY_SECTIONS.get(name)
    assert rp.mrope_interleaved == (SPECS[name].mrope == "interleaved")


@pytest.mark.parametrize("name", FAMILIES)
def test_top_level_and_text_config_agree_and_nothing_is_written(name):
    config = tiny_config(name)
    before = copy.deepcopy(config.to_dict())
    assert rope_parameters(config) == rope_parameters(text_config(config))
    assert config.to_dict() == before


@pytest.mark.parametrize("name", [n for n in FAMILIES if SPECS[n].vision])
def test_text_config_of_vision_language_config(name):
    config = tiny_config(name)
    tc = text_config(config)
    assert tc.hidden_size == 128
    assert text_config(tc) is tc


@pytest.mark.parametrize("name", [n for n in ("llama", "qwen2", "qwen3") if n in FAMILIES])
def test_scaled_rope_keys_and_theta(name):
    rot, _ = rotary(name)
    from tfcompat import _resolve

    key = _resolve.resolve("rope.init", name).plan.config_key
    scaling = {"rope_type": "linear", "factor": 4.0}
    if key == "rope_parameters":
        config = tiny_config(name, rope_parameters=dict(scaling, rope_theta=123456.0))
    else:
        config = tiny_config(name, rope_scaling=scaling, rope_theta=123456.0)
    rp = rope_parameters(config)
    assert rp.rope_type == "linear"
    assert rp.rope_theta == 123456.0
    assert dict(rp.scaling) == {"factor": 4.0}
    # the upstream rotary module agrees: linear scaling divides inv_freq by the factor
    rot = type(rot)(config=config)
    base = 1.0 / (123456.0 ** (torch.arange(0, rp.rotary_dim, 2, dtype=torch.float) / rp.rotary_dim))
    torch.testing.assert_close(rot.inv_freq.float(), base / 4.0)


def test_unscaled_config_reports_default_even_where_rope_scaling_is_an_alias():
    """5.x: config.rope_scaling is never None; tfcompat must not mistake it for scaling (aiter #4742)."""
    config = tiny_config("qwen2")
    rp = rope_parameters(config)
    assert rp.rope_type == "default" and dict(rp.scaling) == {}


def test_rope_parameters_pickle_deepcopy_and_asdict():
    """Records travel: pickled to dataloader workers, deep-copied with configs, dumped with asdict."""
    import dataclasses
    import pickle

    rp = rope_parameters(tiny_config(FAMILIES[0]))
    assert pickle.loads(pickle.dumps(rp)) == rp and copy.deepcopy(rp) == rp
    assert dataclasses.asdict(rp)["rope_theta"] == rp.rope_theta and hash(rp) == hash(copy.deepcopy(rp))
    with pytest.raises(TypeError, match="read-only"):
        rp.scaling["factor"] = 2.0
