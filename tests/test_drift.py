"""Config drift (``tfcompat.config.drift``, ``check --config``): tiny Qwen2 configs saved by 4.51.3, 4.57.6 and
5.24.0 with their own ``save_pretrained`` (``tests/data/checkpoints/*--saved-by-<release>``: theta 1e6; YaRN
scaling), loaded by the release of this environment. Oracle: this release's own rotary module built from the
file (its ``rope_type`` and ``inv_freq``), against what the file sets."""

import glob
import json
import os

import pytest
import torch

from tfcompat.config import drift
from tfcompat.version import transformers_version

from _helpers import modeling

FOLDERS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "data", "checkpoints", "qwen2-*--saved-by-*")))


def _upstream_builds(folder):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    rotary = modeling("qwen2").Qwen2RotaryEmbedding(config=config)
    inv = rotary.inv_freq.double()
    kind = str(getattr(rotary, "rope_type", "default"))
    return kind, (float(inv[1] ** (-inv.numel())) if kind == "default" else None)


@pytest.mark.parametrize("folder", FOLDERS, ids=[os.path.basename(f) for f in FOLDERS])
def test_drift_names_what_this_release_builds_otherwise(folder):
    raw = json.load(open(os.path.join(folder, "config.json")))
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    meant_kind = rope.get("rope_type", rope.get("type", "default"))
    meant_theta = rope.get("rope_theta", raw.get("rope_theta"))
    kind, theta = _upstream_builds(folder)
    want = set()
    if kind != meant_kind:
        want.add("rope_type")
    if theta is not None and abs(theta - meant_theta) > 1e-3 * meant_theta:
        want.add("rope_theta")
    records = drift(folder)
    assert {r.key for r in records} == want, [r.line() for r in records]
    saved_by_5 = raw["transformers_version"].startswith("5.")
    if transformers_version().major == 4 and saved_by_5:
        assert want, "a 4.x release reads no rope_parameters: the 5.x-saved theta must be dropped here"
    else:
        assert not want, "releases of the same major line (and 5.x reading 4.x files) keep these facts"


def test_check_config_exits_2_naming_the_dropped_theta(capsys):
    """The CLI on the 5.24-saved theta: exit 2 with the record on 4.x (text and --json), before any check runs;
    on 5.x the file is read as written (its checks run in test_check_config's configs)."""
    from tfcompat._tools.cli import main

    if transformers_version().major != 4:
        pytest.skip("5.x reads rope_parameters: nothing drifts (test_drift_names_what_this_release_builds_otherwise)")
    folder = next(f for f in FOLDERS if "theta1e6--saved-by-5" in f)
    assert main(["check", "--config", folder]) == 2
    assert "rope_theta: 1000000.0 -> 10000.0" in capsys.readouterr().out
    assert main(["check", "--config", folder, "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert [d["key"] for d in doc["drift"]] == ["rope_theta"] and doc["passed"] is False, doc


def test_drift_of_a_loaded_config_and_bad_input():
    from transformers import AutoConfig

    from tfcompat.errors import ConfigError

    folder = next(f for f in FOLDERS if "theta1e6--saved-by-5" in f)
    loaded = AutoConfig.from_pretrained(folder, local_files_only=True)
    assert [r.key for r in drift(loaded)] == [r.key for r in drift(folder)]
    with pytest.raises(ConfigError, match="cannot read"):
        drift(os.path.join(folder, "missing.json"))
    with pytest.raises(ConfigError, match="pass a config.json path"):
        drift(torch.zeros(1))


VL_FOLDERS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "data", "checkpoints",
                                           "qwen2_vl-*--saved-by-*")))


@pytest.mark.parametrize("folder", VL_FOLDERS, ids=[os.path.basename(f) for f in VL_FOLDERS])
def test_vl_drift_sections_and_nested_text_config(folder):
    """Tiny Qwen2-VL configs with mRoPE sections (8, 4, 4) and theta 5e5, saved by 4.51.3 (flat), 4.57.6 (nested,
    rope_scaling), 5.0.0 and 5.24.0 (nested, rope_parameters). A release with flat VL configs (4.51) keeps a
    nested text_config as a dict and builds its model from the top-level defaults; a 4.x release reads no
    rope_parameters, so its attention finds no sections (upstream's own forward raises: the oracle); 5.x reads
    every file as written."""
    import importlib

    from tfcompat._probe.families import family

    raw = json.load(open(os.path.join(folder, "config.json")))
    keys = {r.key for r in drift(folder)}
    flat = not hasattr(importlib.import_module(family("qwen2_vl").configuration), "Qwen2VLTextConfig")
    saved_by_5 = raw["transformers_version"].startswith("5.")
    if flat and "text_config" in raw:
        assert {"rope_theta", "text_config.hidden_size", "text_config.num_attention_heads"} <= keys, keys
    elif transformers_version().major == 4 and saved_by_5:
        assert keys == {"rope_theta", "mrope_section"}, keys
        from transformers import AutoConfig

        from tfcompat.testing import model_class

        model = model_class("qwen2_vl")(AutoConfig.from_pretrained(folder, local_files_only=True))
        with pytest.raises(TypeError, match="NoneType"), torch.no_grad():  # rope_scaling["mrope_section"]
            ids = torch.tensor([[5, 6, 7, 8]])  # a mask of ones: 4.53-4.57 cannot build a causal mask without one
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    else:
        assert keys == set(), keys
