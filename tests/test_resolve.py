"""Every capability resolves for every family the installed release ships."""

import dataclasses
import importlib.util
import json

import pytest
from packaging.version import Version

import tfcompat
from tfcompat._probe import resolve as _resolve  # private: the resolutions themselves are under test
from tfcompat._probe import source as _source  # private: reading modeling files as text is under test
from tfcompat._probe.families import FAMILIES as SPECS  # private: probe-only facts the public FamilyInfo leaves out
from tfcompat.varlen import flash_attn_available
from tfcompat.version import is_transformers_version_in_range, transformers_version

from _helpers import installed

#: the ``tfcompat`` command's subcommands, which docstrings name in double backticks too
COMMANDS = {"report", "check", "vendor"}


def test_installed_families_follow_the_release():
    have = set(installed())
    assert {"llama", "qwen2", "qwen3", "glm", "glm4", "qwen2_vl", "qwen2_5_vl"} <= have
    # model folders appear at known releases (the README's support matrix)
    assert ("glm4v" in have) == is_transformers_version_in_range("4.53.3")
    assert ("qwen3_vl" in have) == is_transformers_version_in_range("4.57.0")
    assert ("qwen3_5" in have) == is_transformers_version_in_range("5.2.0")


def test_report_resolves_everything():
    tfcompat.clear_cache()
    records = tfcompat.report()
    assert records, "report() returned nothing"
    bad = [r for r in records if r.impl == "unsupported"]
    assert not bad, bad
    kinds = {r.capability.split(":")[0] for r in records}
    assert {"rope.apply", "rope.init", "attention.signature"} <= kinds
    for r in records:
        assert r.transformers == str(transformers_version())
        if r.capability == "varlen.backend":  # not a transformers symbol: which kernel packed attention runs
            assert r.impl == ("flash_attn" if flash_attn_available() else "torch_varlen" if importlib.util.find_spec(
                "torch.nn.attention.varlen") else "sdpa") and "sdpa" in r.reason
        elif r.capability == "rope.impl":  # which apply_rope kernel impl="auto" runs per device
            try:  # installed is not enough: triton 3.2 (torch 2.6) imports only beside setuptools
                import triton.language  # noqa: F401

                triton = True
            except Exception:
                triton = False
            assert r.impl == f"cpu=native cuda={'triton' if triton else 'composite'}" and "composite" in r.reason
        elif r.capability == "kernels.table":  # every RoPE impl and attention kernel, and this process's proofs
            for row in ("rope.triton", "rope.native", "rope.composite", "varlen.flash_attn", "varlen.torch_varlen",
                        "varlen.sdpa"):
                assert row in r.reason
            assert r.impl.endswith("proven") or r.impl == "none proven yet"
        else:
            assert r.reason and r.source.startswith("transformers.")
        json.dumps(r.as_dict())


def test_resolutions_are_cached_frozen_and_clearable():
    first = _resolve.resolve("rope.apply", "qwen2_vl")
    assert _resolve.resolve("rope.apply", "qwen2_vl_text") is first
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.impl = "x"
    tfcompat.clear_cache()
    again = _resolve.resolve("rope.apply", "qwen2_vl")
    assert again is not first and again == first


@pytest.mark.parametrize("name", installed())
def test_rope_apply_probe_matches_the_api_matrix(name):
    """The probes must land where the transformers API matrix says the API moved."""
    plan = _resolve.resolve("rope.apply", name).plan
    v = transformers_version()
    if name in ("qwen2_vl", "qwen2_5_vl", "qwen2_5_omni"):
        assert plan.cos_rows == (3 if v < Version("5.17.0") else 0)
    elif name in ("glm4v", "glm4v_moe"):
        assert plan.cos_rows == (3 if v < Version("5.0.0") else 0)
    else:
        assert plan.cos_rows == 0
    if name == "glm4v":
        assert plan.gptj_cos == ("half" if v < Version("5.17.0") else "pairs")
    if name in ("glm", "glm4"):
        assert plan.gptj_cos == "half"
    if SPECS[name].rotation == "deinterleave":  # MLA: GLM-5 5.3-5.5 rotates NeoX halves, later releases interleave
        res = _resolve.resolve("rope.apply", name)
        assert plan.rotation == ("deinterleave" if res.impl == "apply_rotary_pos_emb_interleave" else "neox")
        assert name != "glm_moe_dsa" or (plan.rotation == "neox") == (v < Version("5.16.0"))
    else:
        assert plan.rotation == SPECS[name].rotation


def test_rope_init_probe():
    plan = _resolve.resolve("rope.init", "llama").plan
    assert plan.config_key == ("rope_parameters" if is_transformers_version_in_range("5.0.0") else "rope_scaling")


def test_every_config_model_type_of_the_release_maps_to_its_family():
    """Text configs carry odd spellings ('Glm4vMoe_text' in 4.5x); the lookup must accept them."""
    import importlib

    from tfcompat._probe.families import family  # private: the family table's own look-up

    for name in installed():
        spec = SPECS[name]
        module = importlib.import_module(spec.configuration)
        for cls_name in (spec.config_class, spec.text_config_class):
            cls = getattr(module, cls_name, None)
            if cls is not None:
                assert family(cls.model_type).name == name, (cls_name, cls.model_type)


@pytest.mark.parametrize("name", installed())
def test_probes_without_source_use_declared_facts_or_fail(monkeypatch, name):
    """A stripped install (no .py sources): every probe either falls back to the family's declared fact with a
    warning, or raises; the fallback equals what the probe finds when it can read the source."""
    import inspect
    import warnings

    from tfcompat.errors import UnsupportedTransformersError

    tfcompat.clear_cache()
    want = _resolve.resolve("rope.init", name).plan
    tfcompat.clear_cache()
    importlib.import_module(SPECS[name].text_modeling)  # imported as a stripped install would be

    def no_source(obj):
        raise OSError("could not get source code")

    monkeypatch.setattr(inspect, "getsource", no_source)
    monkeypatch.setattr(_source, "_read", lambda module: None)  # no .py file: the module is imported
    try:
        if "probe-only" in (SPECS[name].default_mrope_section, SPECS[name].reads_partial_rotary):
            # changed between releases: no fact to fall back to (the other fact's fallback warns first: recorded)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with pytest.raises(UnsupportedTransformersError, match="cannot read the source"):
                    _resolve.resolve("rope.init", name)
            assert all("cannot read the source" in str(w.message) for w in caught)
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = _resolve.resolve("rope.init", name).plan
        assert got.reads_partial_rotary == want.reads_partial_rotary, "declared fact disagrees with the probe"
        assert got.default_mrope_section == want.default_mrope_section, "declared fact disagrees with the probe"
        assert any("cannot read the source" in str(w.message) for w in caught)
        if SPECS[name].nope:  # the declared fact (no rotary) decides, with a warning
            with pytest.warns(RuntimeWarning, match="cannot read the source"):
                assert _resolve.resolve("rope.apply", name).impl == "none"
            return
        with warnings.catch_warnings(record=True) as caught:  # rope.init's fallback warns again: recorded
            warnings.simplefilter("always")
            with pytest.raises(UnsupportedTransformersError, match="cannot read the source"):
                _resolve.resolve("rope.apply", name)
        assert all("cannot read the source" in str(w.message) for w in caught)
    finally:
        monkeypatch.undo()
        tfcompat.clear_cache()


def test_record_types_are_public_frozen_and_picklable():
    """``from tfcompat import Resolution, PatchRecord``: the values report() and patch() return."""
    import pickle

    from tfcompat import PatchRecord, Resolution
    from tfcompat.testing import tiny_model

    res = _resolve.resolve("rope.apply", "qwen2")
    assert type(res) is Resolution and pickle.loads(pickle.dumps(res)) == res
    record = tfcompat.patch(tiny_model("qwen2", num_hidden_layers=1))
    assert type(record) is PatchRecord and pickle.loads(pickle.dumps(record)) == record
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.family = "glm4"
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        tfcompat.Nothing  # noqa: B018


@pytest.mark.parametrize("name", installed())
def test_reading_the_files_decides_as_importing_does(monkeypatch, name):
    """The resolvers read modeling files as text (so ``report`` imports no torch); Python's own view of the
    imported module (inspect, MRO) must lead to the same decisions, for every capability, on this release."""
    tfcompat.clear_cache()
    read = [_resolve.resolve(kind, name) for kind in _resolve.kinds(name)]
    assert isinstance(_resolve._module(SPECS[name].modeling), _resolve._Text)
    tfcompat.clear_cache()
    monkeypatch.setattr(_source, "_read", lambda module: None)
    try:
        imported = [_resolve.resolve(kind, name) for kind in _resolve.kinds(name)]
        assert isinstance(_resolve._module(SPECS[name].modeling), _resolve._Imported)
    finally:
        monkeypatch.undo()
        tfcompat.clear_cache()
    assert read == imported
    assert [r.locator for r in read] == [r.locator for r in imported]
    for r in read:  # the named upstream object is importable
        assert r.target is not None or r.impl == "none"


def test_the_file_reader_survives_unindented_strings_and_follows_bases():
    """Top-level statements are found by their first column; a string whose lines start there cuts a class
    short, and the reader then parses the whole file rather than probe half a class."""
    text = (
        "from ..other.modeling_other import Base as Renamed\n"
        "if True:\n    from .x import helper\n"
        "@decorator\n"
        "class A(Renamed):\n"
        "    def forward(self, x, *args, scale=1, **kwargs):\n"
        "        note = '''\nunindented\n'''\n"
        "        return apply_rotary_pos_emb(x)\n"
        "\n"
        "class B(A):\n    pass\n"
        "CONSTANT = 3\n"
    )
    mod = _resolve._Text("transformers.models.mine.modeling_mine", text)
    forward = mod.method("A", "forward")
    assert forward.params == ("x", "args", "scale", "kwargs")
    assert "unindented" in forward.body and forward.body.rstrip().endswith("apply_rotary_pos_emb(x)")
    assert mod.method("B", "forward") == forward  # inherited from A, found along its bases
    assert mod.has("CONSTANT") and mod.has("helper") and mod.has("Renamed") and not mod.has("unindented")
    assert mod._imports["Renamed"] == ("transformers.models.other.modeling_other", "Base")
    assert mod.method("B", "missing") is None


@pytest.mark.parametrize("name", [n for n in installed() if "rope_index" in _resolve.kinds(n)])
def test_rope_index_resolution_is_the_method_rope_index_calls(name):
    """``report``'s rope_index line names the get_rope_index that tfcompat.embeds.rope_index calls, and its
    frame-split decision (read from the file) equals probing that live function."""
    import inspect

    from tfcompat.embeds import _rope_index_method, _splits_frames_of
    from tfcompat.testing import tiny_config

    res = _resolve.resolve("rope_index", name)
    fn, _ = _rope_index_method(tiny_config(name))
    assert fn.__func__ is res.target.get_rope_index
    assert res.plan.splits_frames == _splits_frames_of(fn.__func__)
    assert res.plan.params == tuple(inspect.signature(fn).parameters)
    assert f"rope_index:{name}" in {r.capability for r in tfcompat.report([name])}


def test_docstrings_name_modules_that_exist():
    """Every :mod:`...` a docstring names (relative to its own package, or absolute) is a module of the package,
    and so is the module a relative :func:`.module.name` (or :class:, :data:, :meth:) names: moved rooms left
    docstrings naming modules that no longer existed (the feature folders moved 17 modules)."""
    import pathlib
    import re

    import tfcompat

    root = pathlib.Path(tfcompat.__file__).parent
    mods = {".".join(p.relative_to(root.parent).with_suffix("").parts) for p in root.rglob("*.py")}
    mods |= {m[: -len(".__init__")] for m in mods if m.endswith(".__init__")}
    stale = []
    for path in root.rglob("*.py"):
        package = ".".join(path.relative_to(root.parent).parent.parts)
        text = path.read_text()
        found = re.findall(r":mod:`~?([.\w]+)`", text)
        found += [".".join(name.split(".")[:2]) if not name.startswith("..") else
                  "." * (len(name) - len(name.lstrip("."))) + name.lstrip(".").split(".")[0]
                  for name in re.findall(r":(?:func|class|data|meth|attr):`~?(\.[.\w]+\.\w+)`", text)]
        for name in found:
            if name.startswith("."):
                dots = len(name) - len(name.lstrip("."))
                base = package.rsplit(".", dots - 1)[0] if dots > 1 else package
                full = f"{base}.{name.lstrip('.')}" if name.lstrip(".") else base
            else:
                full = name if name.split(".")[0] == root.name else f"{root.name}.{name}"
            if full not in mods:
                stale.append(f"{path.name}: {name}")
    assert not stale, stale


def test_docstrings_name_functions_in_the_module_that_defines_them():
    """A ``module.name`` a docstring or comment of the package spells, where ``module`` is a module of the package
    (its own folder's first, else a public one, else the first part of a private path such as ``_rope.fused``),
    names something that module defines: moved functions left ``varlen.bound`` naming the public module for a
    function of ``_attention.kernels``."""
    import ast
    import pathlib
    import re

    import tfcompat

    root = pathlib.Path(tfcompat.__file__).parent
    files = [p for p in root.rglob("*.py") if "__pycache__" not in p.parts]

    def defines(path):
        names = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    names |= {leaf.id for leaf in ast.walk(target) if isinstance(leaf, ast.Name)}
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names |= {a.asname or a.name.split(".")[0] for a in node.names}
        return names

    strings = {n.value for p in files for n in ast.walk(ast.parse(p.read_text()))
               if isinstance(n, ast.Constant) and isinstance(n.value, str)}  # capabilities: ``rope.apply``
    stale, checked = [], 0
    for path in files:
        for dotted in re.findall(r"``([\w.]+\.\w+)``", path.read_text()):
            parts = dotted.split(".")
            if dotted in strings or parts[0] == "config" or parts[-1] == "py":  # a capability, a config, a file
                continue
            target = None
            for i in range(len(parts) - 1, 0, -1):  # the longest module path the name starts with
                for base in (path.parent, root):
                    candidate = base.joinpath(*parts[:i]).with_suffix(".py")
                    if candidate.exists():
                        target, rest = candidate, parts[i:]
                        break
                if target:
                    break
            if target is None or len(rest) != 1:
                continue  # not a module's name (``rope.apply``: a capability) or a method of a class
            checked += 1
            if rest[0] not in defines(target):
                stale.append(f"{path.relative_to(root)}: {dotted} ({target.relative_to(root)} defines no {rest[0]})")
    assert checked >= 5, checked  # the check reads real references (6 when it was written)
    assert not stale, stale


def test_the_public_family_facts_are_the_tables():
    """tfcompat.testing.families(): every family the table knows (the installed ones by default), with the facts the
    tests and frameworks pick by, read from the family table."""
    from tfcompat._probe.families import FAMILIES  # private: the family table's own fields
    from tfcompat.testing import families

    assert list(families(installed_only=False)) == list(FAMILIES)
    assert set(families()) == set(installed()) and set(installed()) <= set(FAMILIES)
    for name, info in families(installed_only=False).items():
        fam = FAMILIES[name]
        assert (info.vision, info.mrope, info.nope, info.patch_refusal, info.embeds_refusal, info.since) == \
            (fam.vision, fam.mrope, fam.nope, fam.patch_refusal, fam.embeds_refusal, fam.since)
        assert info.text_family == (fam.text_family or name) and info.audio == ("audio_config" in fam.tiny_top)


def test_docstrings_name_private_things_that_exist():
    """Every private name a docstring or comment of the package spells in double backticks (``_name``,
    ``_room.module``, ``name.py``) or as ``tfcompat._name`` is a module, a file or a name the package defines
    or spells in its code (an upstream hook it looks up by name), or the installed transformers defines: moved rooms
    left "``_patch``", "``_boundaries``", "tfcompat._window", "``_checks``" and "``_backends``" naming modules that no
    longer existed."""
    import ast
    import pathlib
    import re

    import transformers

    import tfcompat

    root = pathlib.Path(tfcompat.__file__).parent
    files = [p for p in root.rglob("*.py") if "__pycache__" not in p.parts]
    modules = {p.stem for p in files} | {p.parent.name for p in files}
    checkout = pathlib.Path(__file__).resolve().parent.parent  # setup.py beside the package
    known = modules | {p.name for p in files} | {p.name for p in checkout.glob("*.py")}
    aliases: dict = {}
    defined: set = set()  # the package's functions and classes (``patch``)
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):  # what the package defines, not every name it uses
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                known.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for leaf in ast.walk(target):
                        if isinstance(leaf, ast.Name):
                            known.add(leaf.id)
                        elif isinstance(leaf, ast.Attribute):
                            known.add(leaf.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                known.add(node.value)  # a name the code looks up (getattr, a hook's name)
            elif isinstance(node, ast.alias):  # an import's name means something in its own file only
                aliases.setdefault(path, set()).add(node.asname or node.name.split(".")[-1])
            elif isinstance(node, ast.arg):  # a parameter the docstring describes (``window``)
                known.add(node.arg)
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined.add(node.name)
    upstream = pathlib.Path(transformers.__file__).parent
    stale = []
    for path in files:
        text = path.read_text()
        stale += [f"{path.relative_to(root)}: tfcompat.{name}" for name in re.findall(r"\btfcompat\.(_\w+)", text)
                  if name not in modules]
        for name in re.findall(r"``(_[\w.]+|[\w]+\.py)``", text):
            parts = [name] if name.endswith(".py") else [p for p in name.split(".") if p]
            if all(p in known or p in aliases.get(path, ()) for p in parts):
                continue
            if len(parts) == 1 and not name.endswith(".py") and \
                    any(f"def {name}(" in f.read_text() for f in upstream.rglob("*utils*.py")):
                continue  # upstream's own helper (``_compute_yarn_parameters``)
            stale.append(f"{path.relative_to(root)}: {name}")
        # a plain ``module`` names a sibling of this file's folder, a public module, or a name the package defines:
        # a module moved to another feature's folder is named by its path (``_attention.boundaries``)
        siblings = {p.stem for p in path.parent.glob("*.py")} | {p.name for p in path.parent.iterdir() if p.is_dir()}
        here = {n.id for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Name)} | {
            getattr(n, "arg", None) or getattr(n, "name", None) or getattr(n, "value", None)
            for n in ast.walk(ast.parse(text)) if isinstance(n, (ast.arg, ast.FunctionDef, ast.ClassDef, ast.Constant))}
        for name in re.findall(r"``([a-z]\w*)``", text):
            elsewhere = name in modules and name not in siblings and not (root / f"{name}.py").exists()
            if elsewhere and name not in here | defined | COMMANDS | {root.name} and name not in aliases.get(path, ()):
                stale.append(f"{path.relative_to(root)}: {name} (a module of another folder)")
    assert not stale, stale
