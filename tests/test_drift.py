"""Config drift (``tfcompat.config.drift``, ``check --config``): tiny Qwen2 configs saved by 4.51.3, 4.57.6 and
5.24.0 with their own ``save_pretrained`` (``tests/data/checkpoints/*--saved-by-<release>``: theta 1e6; YaRN
scaling), loaded by the release of this environment. Oracle: this release's own rotary module built from the
file (its ``rope_type`` and ``inv_freq``), against what the file sets."""

import glob
import json
import os

import pytest
import torch
from packaging.version import Version

from tfcompat.config import drift
from tfcompat.errors import ConfigError
from tfcompat.version import transformers_version

from _helpers import installed, modeling

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
    from tfcompat._tools.cli import main  # private: the command, run in process

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

    from tfcompat._probe.families import family  # private: the family table's own look-up

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


def _windowed_layers(folder):
    """The layers this release's own model (built from the file as it loads it, eager attention) windows: the
    last query of an 8-token row sees fewer than every key."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    ids = torch.arange(3, 11).view(1, -1)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_attentions=True, use_cache=False)
    return {i for i, a in enumerate(out.attentions) if int((a[0, :, -1, :].abs().amax(0) > 0).sum()) < ids.shape[1]}


def test_sliding_window_drift_names_the_layers_this_release_windows(capsys):
    """A Qwen2 saved by 5.24 with a window of 4 on layer 1 only (`layer_types`): 4.51/4.52 window every layer
    (one mask for all); the record says so exactly where this release's own model (not the probe's tiny copy)
    windows other layers than the file, and `check --config` exits 2 naming it."""
    from tfcompat._tools.cli import main  # private: the command, run in process

    folder = os.path.join(os.path.dirname(__file__), "data", "checkpoints", "windows-qwen2-layer1--saved-by-5.24.0")
    windowed = _windowed_layers(folder)
    records = [r for r in drift(folder) if r.key == "sliding_window"]
    if windowed == {1}:
        assert not records, [r.line() for r in records]
        return
    assert len(records) == 1 and records[0].in_file == "4 on layers [1]", [r.line() for r in records]
    assert records[0].built == ("4 on all 2 layers" if windowed == {0, 1} else f"4 on layers {sorted(windowed)}")
    assert main(["check", "--config", folder]) == 2
    assert "sliding_window: '4 on layers [1]'" in capsys.readouterr().out


def test_a_window_no_shorter_than_every_position_is_no_drift():
    """Qwen2.5's files set `use_sliding_window: false` beside a window: a window no shorter than the model's
    longest position changes no number, whatever a release does with it; a shorter one on a release that
    windows anyway would be named (the case above)."""
    raw = json.load(open(os.path.join(os.path.dirname(__file__), "data", "configs", "Qwen__Qwen2.5-3B-Instruct.json")))
    assert raw["use_sliding_window"] is False and raw["sliding_window"] >= raw["max_position_embeddings"]
    assert not [r for r in drift(os.path.join(os.path.dirname(__file__), "data", "configs",
                                              "Qwen__Qwen2.5-3B-Instruct.json")) if r.key == "sliding_window"]


@pytest.mark.parametrize("name,interleaved", [("qwen3_vl", False), ("qwen3_vl", True), ("qwen2_vl", True),
                                              ("qwen2_vl", False)])
def test_mrope_interleaved_the_release_does_not_follow(name, interleaved, tmp_path):
    """`mrope_interleaved` in a file: Qwen3-VL folds its sections interleaved and Qwen2-VL in contiguous T/H/W
    blocks in every release that ships them, whatever the key says; a file saying otherwise is named."""
    from tfcompat.testing import tiny_config

    from _helpers import installed

    if name not in installed():
        pytest.skip("not in this release")
    tiny_config(name).save_pretrained(tmp_path)
    raw = json.load(open(tmp_path / "config.json"))
    text = raw.get("text_config", raw)
    key = "rope_parameters" if isinstance(text.get("rope_parameters"), dict) else "rope_scaling"
    text.setdefault(key, {"rope_type": "default", "mrope_section": [2, 1, 1]})
    (text[key] if isinstance(text.get(key), dict) else text)["mrope_interleaved"] = interleaved
    raw.pop("transformers_version")  # edited by hand: no saving release to compare with (the keys are read)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    records = [r for r in drift(str(tmp_path)) if r.key == "mrope_interleaved"]
    if interleaved == (name == "qwen3_vl"):
        assert not records, [r.line() for r in records]
    else:
        assert len(records) == 1 and records[0].in_file is interleaved and records[0].built is (not interleaved)


@pytest.mark.parametrize("name", ["qwen2", "qwen2_moe", "qwen2_vl"])
def test_head_dim_drift_against_the_attention_upstream_builds(name, tmp_path):
    """A file whose head_dim is twice hidden_size // heads: named exactly where this release's own model builds
    other heads (Qwen2-MoE on 4.51, Qwen2-VL up to 5.0 read no head_dim); where it cannot build the attention at
    all (Qwen2-MoE on 4.57 raises), the one "itself cannot run" error."""
    from transformers import AutoConfig

    from tfcompat._probe.families import family  # private: the family table's own look-up
    from tfcompat.errors import TfcompatError
    from tfcompat.testing import model_class, tiny_config

    from _helpers import installed

    if name not in installed():
        pytest.skip("not in this release")
    tiny_config(name).save_pretrained(tmp_path)
    raw = json.load(open(tmp_path / "config.json"))
    text = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
    text["head_dim"] = 2 * text["hidden_size"] // text["num_attention_heads"]
    raw.pop("transformers_version")  # edited by hand: no saving release to compare with (the keys are read)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = AutoConfig.from_pretrained(tmp_path, local_files_only=True)
    try:
        model = model_class(name)(config)
    except ValueError:
        with pytest.raises(TfcompatError, match="itself cannot run this config"):
            drift(str(tmp_path))
        return
    from tfcompat._probe import resolve  # private: the resolutions are under test

    cls = getattr(resolve.resolve("attention.signature", name).target, family(name).attention)
    attention = next(m for m in model.modules() if isinstance(m, cls))  # 4.51: its sdpa subclass
    heads = getattr(config, "text_config", config).num_attention_heads
    built = attention.q_proj.out_features // heads
    records = [r for r in drift(str(tmp_path)) if r.key == "head_dim"]
    assert len(records) == (built != text["head_dim"]), [r.line() for r in records]
    if records:
        assert (records[0].in_file, records[0].built) == (text["head_dim"], built)


@pytest.mark.parametrize("edit", ["partial_rotary_factor", "string_theta"])
def test_width_and_type_drift_against_what_upstream_builds(edit, tmp_path):
    """A Qwen2 file (saved by this release) edited as another release or a hand might write it: a partial rotary
    factor (Qwen2's attention rotates q/k whole; 5.x's rotary module ignores the factor, 4.x's builds it), theta
    as a string. The record is there exactly where this release's own rotary module builds otherwise (oracle:
    its width), and a string theta is always named (or upstream's refusal to build it said)."""
    from transformers import AutoConfig

    from tfcompat.testing import model_class, tiny_config

    tiny_config("qwen2").save_pretrained(tmp_path)
    raw = json.load(open(tmp_path / "config.json"))
    rope = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else raw
    if edit == "partial_rotary_factor":
        rope["partial_rotary_factor"] = 0.5
        raw["partial_rotary_factor"] = 0.5
    else:
        rope["rope_theta"] = "1000000.0"
    raw.pop("transformers_version")  # edited by hand: no saving release to compare with (the keys are read)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    if edit == "string_theta":
        try:
            records = drift(str(tmp_path))
        except Exception as exc:  # this release cannot build a rotary module from a string theta: said so
            assert "itself cannot run this config" in str(exc), exc
            return
        assert [r.why for r in records if r.key == "rope_theta"] == ["a string in the file; a number is meant"]
        return
    config = AutoConfig.from_pretrained(tmp_path, local_files_only=True)
    model = model_class("qwen2")(config)
    head_dim = model.model.layers[0].self_attn.q_proj.out_features // config.num_attention_heads
    built_rotary = 2 * model.model.rotary_emb.inv_freq.numel()
    keys = {r.key for r in drift(str(tmp_path))}
    assert ("partial_rotary_factor" in keys) == (built_rotary != head_dim // 2), (keys, built_rotary)


SWEEP = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "data", "drift", "*--saved-by-*")))


def _this_release_computes(folder):
    """The logits this release's own model computes from the saved file (loaded as this release loads it) on the
    sweep's weights and row; None where the release cannot build or run it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "drift_sweep", os.path.join(os.path.dirname(__file__), "..", "tools", "drift_sweep.py"))
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    from transformers import AutoConfig

    try:
        return sweep.logits(AutoConfig.from_pretrained(folder, local_files_only=True))
    except Exception:
        return None


def test_drift_sweep_against_the_models_themselves():
    """Tiny configs saved by 4.51.3, 4.52.4, 4.53.3, 4.57.6, 5.0.0, 5.10.4 and 5.24.0 (tools/drift_sweep.py; 173
    folders: Qwen2, Qwen3, Llama, GLM-4, Qwen2-MoE, Qwen3-MoE, GLM-4.5-MoE, GLM-MoE-DSA; sliding windows as each
    release writes them, MoE windows, YaRN with the explicit and the implicit factor, partial rotary factors, GLM-4's
    rotary, a theta), loaded by this environment's release. Oracle: the saving release's own model (its logits,
    saved beside the file) against this release's model of the same file, weights and row. Where they differ (or
    this release cannot run the file), drift or check must say so (a miss otherwise); where they agree, it must say
    nothing (a false alarm otherwise). 0 of each."""
    import transformers

    from tfcompat.errors import TfcompatError

    assert len(SWEEP) >= 170, "the sweep's saved files are missing"
    variants = {os.path.basename(f).split("--")[0] for f in SWEEP}
    assert {"qwen2-yarn_explicit", "qwen3-yarn_implicit", "qwen2_moe-w_on1", "qwen3_moe-yarn_explicit",
            "glm4_moe-partial_quarter", "glm_moe_dsa-default"} <= variants, sorted(variants)
    misses, false_alarms, agreed, drifted = [], [], 0, 0
    for folder in SWEEP:
        want = torch.tensor(json.load(open(os.path.join(folder, "logits.json"))))
        got = _this_release_computes(folder)
        differs = got is None or got.shape != want.shape or not torch.allclose(got, want, rtol=1e-3, atol=1e-3)
        try:
            said = [d.line() for d in drift(folder)]
        except TfcompatError as exc:
            said = [f"refused: {exc}"]
        name = os.path.basename(folder)
        if differs and not said:
            misses.append(name)
        elif not differs and said:
            false_alarms.append(f"{name}: {said}")
        drifted += differs
        agreed += not differs
    assert not misses and not false_alarms, (f"transformers {transformers.__version__}: {len(misses)} misses "
                                             f"{misses}, {len(false_alarms)} false alarms {false_alarms}")
    assert agreed and drifted or transformers.__version__ in ("4.51.3",), (agreed, drifted)


def test_the_partial_rotary_readings_drift_assumes_are_this_releases():
    """What drift assumes a saving release built from ``partial_rotary_factor`` (_saved_partial), held to this
    release's own rotary modules: on 4.x every family reads the top-level key; on 5.x the families whose table entry
    says reads_partial_rotary=False rotate the whole head wherever the key is, those with True read rope_parameters."""
    import tempfile

    from tfcompat._probe import drift as probe  # private: the drift checker itself is under test
    from tfcompat._probe.families import FAMILIES  # private: the family table's own fields
    from tfcompat.testing import tiny_config

    from _helpers import installed

    major = transformers_version().major
    checked = []
    for name in sorted(set(installed()) & set(FAMILIES)):
        if FAMILIES[name].nope:
            continue
        try:
            raw = tiny_config(name).to_dict()
        except Exception:
            continue
        raw.pop("transformers_version", None)
        text = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
        if major < 5:
            text["partial_rotary_factor"] = 0.5
        else:
            text["rope_parameters"] = dict(text.get("rope_parameters") or {"rope_type": "default",
                                                                           "rope_theta": 10000.0},
                                           partial_rotary_factor=0.5)
        folder = tempfile.mkdtemp()
        json.dump(raw, open(os.path.join(folder, "config.json"), "w"))
        try:
            built = probe._built(probe.load_config(folder))
        except Exception:  # this release cannot build the family's rotary from a tiny file (the omni models)
            continue
        if major >= 5 and FAMILIES[name].reads_partial_rotary not in (True, False):
            continue  # changed between 5.x releases: drift reads the file's keys
        whole = major >= 5 and FAMILIES[name].reads_partial_rotary is False
        assert built["rotary_dim"] == (built["head_dim"] if whole else built["head_dim"] // 2), (name, built)
        checked.append(name)
    assert {"llama", "qwen2", "qwen3"} <= set(checked), checked


def _written(tmp_path, raw, name="cfg"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def test_drift_says_what_transformers_refuses_in_a_file(tmp_path):
    """A file this release refuses (5.x checks ``layer_types`` against ``num_hidden_layers``; 4.x loads it), or a
    family it does not ship: ``drift(path)`` returns what this release builds, or raises a ConfigError naming the
    saving release or the first release with the family; never transformers' own error."""
    from transformers import AutoConfig

    from tfcompat._probe.families import FAMILIES  # private: every family tfcompat knows, shipped here or not
    from tfcompat.errors import ConfigError
    from tfcompat.testing import families, tiny_config

    raw = dict(tiny_config("qwen2").to_dict(), layer_types=["full_attention"], transformers_version="5.99.0")
    folder = _written(tmp_path, raw)
    try:
        AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # noqa: BLE001  (the oracle: does this release refuse the file?)
        refused = exc
    else:
        refused = None
    if refused is None:
        assert isinstance(drift(str(folder)), list)
    else:
        with pytest.raises(ConfigError, match="saved by transformers 5.99.0") as err:
            drift(str(folder))
        assert type(refused).__name__ in str(err.value)
    missing = [n for n in FAMILIES if n not in families() and not FAMILIES[n].nope]
    for n in missing[:3]:
        path = _written(tmp_path, {"model_type": n, "transformers_version": "5.99.0"}, name=n)
        with pytest.raises(ConfigError, match=f"first shipped in transformers {FAMILIES[n].since}"):
            drift(str(path))


YARN = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "data", "checkpoints", "qwen2yarn--saved-by-*")))


@pytest.mark.parametrize("folder", YARN, ids=[os.path.basename(f) for f in YARN])
def test_yarn_factor_drift_against_the_saving_releases_own_rotary(folder):
    """A YaRN file with factor 4 beside max_position_embeddings / original_max_position_embeddings = 128 / 64 = 2,
    saved by 4.51.3 and by 5.24.0 with their own ``save_pretrained``; ``rotary.json`` holds the inv_freq and the
    attention scaling the saving release's own rotary module built from it. The oracle: this release's rotary
    module built from the same file. ``drift`` names the YaRN factor exactly when the two differ."""
    from transformers import AutoConfig

    saved = json.load(open(os.path.join(folder, "rotary.json")))
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    rotary = modeling("qwen2").Qwen2RotaryEmbedding(config=config)
    inv = rotary.inv_freq.double()
    differs = not torch.allclose(inv, torch.tensor(saved["inv_freq"], dtype=torch.float64), rtol=1e-6) or \
        abs(float(rotary.attention_scaling) - saved["attention_scaling"]) > 1e-6
    records = drift(folder)
    found = [d for d in records if d.key.startswith("rope_scaling.factor")]
    # a release that builds no YaRN from the file at all (4.x reads no rope_parameters) says so by rope_type
    named = found or [d for d in records if d.key == "rope_type" and d.built != "yarn"]
    assert bool(named) == differs, (saved["release"], str(transformers_version()), records, differs)
    if found:
        assert "set " in found[0].why and saved["release"] in found[0].why


QWEN2_MOE_WINDOWS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "data", "checkpoints",
                                                  "windows-qwen2_moe-*--saved-by-*")))


@pytest.mark.parametrize("folder", QWEN2_MOE_WINDOWS, ids=[os.path.basename(f) for f in QWEN2_MOE_WINDOWS])
def test_qwen2_moe_windows_against_the_saving_releases_own_model(folder):
    """Qwen2-MoE files with ``use_sliding_window: true``, a window of 4 and ``max_window_layers`` 0 or 1, written by
    ``save_pretrained`` of 4.51.3, 4.57.6 and 5.24.0. ``windows.json`` beside each: the layers the saving release's own
    eager model windows (4.x: every layer, one mask; 5.x: the even layers below ``max_window_layers``, saved as
    ``layer_types``). ``drift`` names the window exactly when this release's own model windows other layers."""
    if "qwen2_moe" not in installed():
        pytest.skip("this release ships no Qwen2-MoE")
    saved = set(json.load(open(os.path.join(folder, "windows.json")))["windowed_layers"])
    here = _windowed_layers(folder)
    records = [r for r in drift(folder) if r.key == "sliding_window"]
    if here == saved:
        assert not records, [r.line() for r in records]
        return
    assert len(records) == 1, [r.line() for r in drift(folder)]
    named = "all 3 layers" if saved == {0, 1, 2} else f"layers {sorted(saved)}" if saved else "no layer"
    assert records[0].in_file == f"4 on {named}", records[0].line()


DSA = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "data", "checkpoints", "glm_moe_dsa--saved-by-*")))


def _dsa_layout(cls):
    """How the installed release's own class rotates (its forward's source, imported)."""
    import inspect

    src = inspect.getsource(getattr(modeling("glm_moe_dsa"), cls).forward)
    return "interleaved" if "apply_rotary_pos_emb_interleave(" in src else "neox"


@pytest.mark.parametrize("folder", DSA, ids=[os.path.basename(f) for f in DSA])
def test_glm_moe_dsa_rotation_layout_against_the_saving_release(folder):
    """GLM-MoE-DSA files written by 5.10.4 and 5.24.0 (``partial_rotary_factor`` 0.5), with ``layout.json`` read from
    the saving release's own attention and indexer forwards (NeoX halves or interleaved pairs) and rotary module (the
    channels it rotates). ``drift`` names each part exactly where this release's own classes rotate it the other
    way, and the partial rotary factor exactly where this release's rotary module rotates another width."""
    if "glm_moe_dsa" not in installed():
        pytest.skip("this release ships no GLM-MoE-DSA")
    saved = json.load(open(os.path.join(folder, "layout.json")))
    try:
        records = {r.key: r for r in drift(folder)}
    except ConfigError as exc:  # an older release's strict config refuses a newer file's keys: said, not guessed
        assert "cannot load" in str(exc) and saved["release"] in str(exc)
        assert transformers_version() < Version(saved["release"])
        return
    for key, cls, part in (("rotation_layout", "GlmMoeDsaAttention", "attention"),
                           ("indexer_rotation_layout", "GlmMoeDsaIndexer", "indexer")):
        here = _dsa_layout(cls)
        if here == saved[part]:
            assert key not in records, records[key].line()
        else:
            assert key in records, [r.line() for r in records.values()]
            name = {"neox": "NeoX halves", "interleaved": "interleaved pairs"}
            assert records[key].in_file.endswith(name[saved[part]]) and records[key].built.endswith(name[here])
    # partial_rotary_factor 0.5 in rope_parameters: 5.3-5.9 rotate half the rope channels, 5.10+ all of them; the
    # width this release's own rotary module builds from the file against the saving release's
    from transformers import AutoConfig

    width = 2 * modeling("glm_moe_dsa").GlmMoeDsaRotaryEmbedding(
        config=AutoConfig.from_pretrained(folder, local_files_only=True)).inv_freq.shape[0]
    assert ("partial_rotary_factor" in records) == (width != saved["rotary_width"]), \
        (width, saved["rotary_width"], [r.line() for r in records.values()])
