"""rope_parameters against what the installed rotary module actually uses."""

import copy

import pytest
import torch

from tfcompat.config import rope_parameters, text_config
from tfcompat.errors import ConfigError
from tfcompat.testing import TINY_SECTIONS, families, tiny_config

from _helpers import installed, rotary, rotary_families

SPECS = families(installed_only=False)  # the family facts, from the public face


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
    from tfcompat._probe import resolve as _resolve  # private: the resolutions are under test

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


def test_a_rope_type_the_rotary_module_cannot_build_is_refused():
    """A RoPE dict shared between the text and the vision config: on releases whose vision config defaults
    to the 'axial' type, standardising it in place turns the text config's type into 'axial', which the text
    rotary module cannot build (KeyError). Upstream cannot run it; tfcompat says why instead of reporting it."""
    from tfcompat.config import rope_parameters

    if "qwen3_vl" not in installed():
        pytest.skip("no qwen3_vl in this release")
    from transformers import Qwen3VLConfig
    from transformers.models.qwen3_vl import modeling_qwen3_vl

    shared = {"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True, "rope_theta": 1e4}
    text = {"head_dim": 8, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2}
    text_rotary = modeling_qwen3_vl.Qwen3VLTextRotaryEmbedding
    key = "rope_parameters" if hasattr(text_rotary, "compute_default_rope_parameters") else "rope_scaling"
    config = Qwen3VLConfig(text_config={**text, key: shared}, vision_config={"rope_parameters": shared})
    try:
        text_rotary(config=config.text_config)
    except Exception as exc:  # upstream cannot build it on this release
        with pytest.raises(ConfigError, match="rope_type 'axial'.*own dict"):
            rope_parameters(config)
        assert isinstance(exc, KeyError)
    else:
        assert rope_parameters(config).mrope_section == (2, 1, 1)


def test_a_config_dict_is_refused_with_model_type_too():
    """rope_parameters(dict, model_type=...) (a config.json read with json.load) raised a raw AttributeError; it is
    the refusal a dict gets everywhere, naming the fix (AutoConfig.for_model)."""
    from tfcompat.errors import ModelError

    raw = tiny_config("qwen2").to_dict()
    for kwargs in ({}, {"model_type": "qwen2"}):
        with pytest.raises(ModelError, match=r"got a dict .*AutoConfig\.for_model"):
            rope_parameters(raw, **kwargs)
