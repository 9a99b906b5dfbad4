"""transformers' own model-tester configs, tried as a new user would: whatever the installed upstream builds and
runs from them, tfcompat computes the same (or the tester's config is one this release's own config class refuses).

Each file in ``data/testers`` holds the keyword arguments a family's ``ModelTester.get_config()`` passes to the
config class (cited there, with the commit where known); testers built on ``CausalLMModelTester`` hold only their
overrides, and the tester's own rule (``_causal_lm_tester.json``) turns them into keyword arguments against this
release's config class, as the tester does. Per config:

- ``rope_parameters`` equals upstream's rotary module and ``apply_rope`` (native and in place, fp32 and bf16)
  equals upstream's rotary function, forward and backward, on the tester's config itself;
- ``tfcompat check --config`` on it (the config scaled down with every RoPE/attention setting kept: sections,
  head_dim, partial rotary, windows and layer types, MLA widths) passes every check, the patched model on a
  packed row against upstream on the padded batch among them (sequences longer than a tester's window).
"""

import copy
import functools
import inspect
import itertools
import json
import os
import pathlib

import pytest

from tfcompat._tools.checks import run_family  # private: the command's family checks, run on the testers' configs
from tfcompat._tools.cli import main  # private: the command's own entry (tests of the command run it in process)

from _helpers import installed

DATA = pathlib.Path(__file__).resolve().parent / "data" / "testers"
TESTERS = sorted(p for p in DATA.glob("*.json") if not p.name.startswith("_"))
_ROPE_CHECKS = ("config.rope_parameters", "rope.native.fp32", "rope.inplace.fp32", "rope.native.bf16")


def _matching(attrs, config_class, forced=()):
    """The testers' get_config rule: every attribute named like a parameter of the config class's __init__ (or
    like the attribute_map alias of one)."""
    names = list(inspect.signature(config_class.__init__).parameters)
    alias = {v: k for k, v in getattr(config_class, "attribute_map", {}).items()}
    attrs = copy.deepcopy(attrs)  # each sub-config its own dicts: config classes standardise them in place
    out = {}
    for key in names + list(forced):
        if key in attrs and key != "self":
            out[key] = attrs[key]
        elif key in alias and alias[key] in attrs:
            out[key] = attrs[alias[key]]
    return out


def _kwargs(doc, config_class):
    """What the tester passes to the config class on this release."""
    if "kwargs" in doc:
        return dict(doc["kwargs"])
    base = json.loads((DATA / "_causal_lm_tester.json").read_text())["attributes"]
    if "causal_lm" in doc:  # CausalLMModelTester
        attrs = {**base, **doc["causal_lm"]}
        attrs.setdefault("head_dim", attrs["hidden_size"] // attrs["num_attention_heads"])
        if "head_dim" not in doc["causal_lm"]:
            attrs["head_dim"] = attrs["hidden_size"] // attrs["num_attention_heads"]
        return _matching(attrs, config_class, forced=("pad_token_id",))
    # VLMModelTester: the same defaults and rule, per sub-config; the tester's get_config names the top level
    attrs = {**base, **doc["vlm"]}
    if "head_dim" not in doc["vlm"]:
        attrs["head_dim"] = attrs["hidden_size"] // attrs["num_attention_heads"]
    subs = config_class.sub_configs
    vision = doc.get("vision") or {**_matching(attrs, subs["vision_config"]), **doc.get("vision_update", {})}
    return {"text_config": _matching(attrs, subs["text_config"]), "vision_config": vision, **doc["top"]}


def _config_class(family_type, model_type):
    """The config class of ``model_type``: a family's own, or one of its parts (the decoder alone, an omni
    thinker), found among the family's sub-configs where the release does not register it by name."""
    from transformers import CONFIG_MAPPING

    if model_type in CONFIG_MAPPING:
        return CONFIG_MAPPING[model_type]
    for sub in getattr(CONFIG_MAPPING[family_type], "sub_configs", {}).values():
        if getattr(sub, "model_type", None) == model_type:
            return sub
    pytest.skip(f"this release has no config class for {model_type}")


@functools.lru_cache(maxsize=None)
def _upstream_error(path):
    """Upstream's own error on the tester's config (None: it runs), probed once per tester and process."""
    name, _, config = _build(path)
    try:
        _upstream_or_skip(name, config)
    except pytest.skip.Exception as exc:
        return str(exc)
    return None


def _tester_config(path):
    error = _upstream_error(path)
    if error is not None:
        pytest.skip(error)
    return _build(path)


def _build(path):
    name = path.stem.split("--")[0]  # "<family>--<variant>": another release's version of the tester
    if name not in installed():
        pytest.skip(f"transformers of this environment has no {name}")
    doc = json.loads(path.read_text())
    config_class = _config_class(name, doc.get("model_type", name))
    kwargs = _kwargs(doc, config_class)
    try:
        config = config_class(**kwargs)
    except Exception as exc:  # the tester is written for another release's config class
        pytest.skip(f"this release's {config_class.__name__} refuses the tester's arguments: {exc}")
    return name, kwargs, config


def _upstream_or_skip(name, config):
    """Upstream's own model, built from the tester's config, on a short text row; where it cannot be built or
    run on this release (a tester written for another release's config keys, sections this release's own
    split refuses), there is nothing to equal: tfcompat's refusal is checked by the fail-closed tests."""
    import importlib

    import torch

    from tfcompat._probe.families import family  # private: the family table's own look-up

    module = importlib.import_module(family(name).modeling)
    classes = [c for c in vars(module).values() if isinstance(c, type) and getattr(c, "config_class", None) is
               type(config) and c.__name__.endswith(("ForConditionalGeneration", "ForCausalLM"))]
    try:
        torch.manual_seed(0)
        model = classes[0](config).eval()
        with torch.no_grad():
            ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    except Exception as exc:
        pytest.skip(f"upstream itself cannot run this tester config here: {type(exc).__name__}: {exc}"[:300])


def _tester_model_type(path):
    return json.loads(path.read_text()).get("model_type", path.stem.split("--")[0])


def test_every_served_family_has_a_tester_config():
    from tfcompat._probe.families import FAMILIES  # private: the family table's own fields

    have = {p.stem.split("--")[0] for p in TESTERS}
    assert have == set(FAMILIES), sorted(set(FAMILIES) ^ have)
    for path in TESTERS:
        assert json.loads(path.read_text())["source"].startswith("huggingface/transformers")


@pytest.mark.parametrize("path", TESTERS, ids=[p.stem for p in TESTERS])
def test_rope_on_the_tester_config_equals_upstream(path):
    name, _, config = _tester_config(path)
    # the rope checks come first: stop there (the model checks run scaled, in the test below)
    results = list(itertools.takewhile(lambda r: r["check"] in _ROPE_CHECKS, run_family(name, config=config)))
    assert results, "the rope checks ran"
    failed = [r for r in results if not r["passed"]]
    assert not failed, failed


@pytest.mark.parametrize("path", TESTERS, ids=[p.stem for p in TESTERS])
def test_check_config_passes_on_the_tester_config(path, tmp_path, capsys):
    if os.environ.get("TFCOMPAT_BOUNDARY_TESTS") == "skip":
        pytest.skip("check --config on the tester configs runs on the boundary releases (tox.ini says which)")
    name, kwargs, _ = _tester_config(path)
    from transformers import CONFIG_MAPPING

    model_type = _tester_model_type(path)
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"AutoConfig of this release does not load model_type {model_type} from a config.json")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, **kwargs}))
    code = main(["check", "--config", str(tmp_path), "--json"])
    doc = json.loads(capsys.readouterr().out)
    failed = [r for r in doc.get("results", []) if not r["passed"]]
    assert code == 0 and doc["passed"] and not failed, doc.get("error") or failed
