"""Vendorability: relative imports only, and a copy under another name runs a full family check."""

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest

from _helpers import BOUNDARY_ONLY, ONCE

pytestmark = ONCE  # copies of the package: the same code under another name, whatever the release

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tfcompat"


def test_no_module_imports_the_package_absolutely():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                # dotted strings handed to importlib would name the package too
                names = [node.value] if node.value.startswith("tfcompat.") and " " not in node.value else []
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                          if n == "tfcompat" or n.startswith("tfcompat.")]
    assert not offenders, offenders


def test_the_family_table_is_the_only_place_a_family_is_named():
    """Behaviour keyed on a family is a field of its table entry: no other module of the package holds a
    family's name or alias in code (docstrings may, for runnable examples)."""
    from tfcompat._probe.families import FAMILIES  # private: the family table's own fields

    names = {n for f in FAMILIES.values() for n in (f.name, *f.aliases)}
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).as_posix() == "_probe/families.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)
                      and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                found = {w for w in re.findall(r"[A-Za-z0-9_.]+", node.value) if w in names}
                offenders += [f"{path.relative_to(ROOT)}:{node.lineno}: {w}" for w in sorted(found)]
    assert not offenders, offenders


def test_version_is_a_literal():
    init = (PACKAGE / "__init__.py").read_text()
    assert "importlib.metadata" not in init and '__version__ = "' in init


def test_vendored_copy_runs_a_family_check(tmp_path):
    """A fresh interpreter that cannot import the original package runs a family check through the copy. What
    it proves (relative imports, no metadata) does not depend on the release: it runs on the lowest and the
    newest tested release (one interpreter start and a family check, ~9 s, spared in the others)."""
    from tfcompat import version

    installed = str(version.transformers_version())
    if installed not in (version.MIN_TRANSFORMERS, version.TESTED_MAX_TRANSFORMERS) and \
            not os.environ.get("TFCOMPAT_VENDOR_EVERYWHERE"):
        pytest.skip(f"runs with transformers {version.MIN_TRANSFORMERS} and {version.TESTED_MAX_TRANSFORMERS}")
    dest = tmp_path / "myproj" / "_vendor" / "tfcompat"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "tfcompat", "vendor", str(dest)], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    (tmp_path / "myproj" / "__init__.py").write_text("")
    (tmp_path / "myproj" / "_vendor" / "__init__.py").write_text("")
    code = (
        "import sys\n"
        "from myproj._vendor import tfcompat as t\n"
        "from myproj._vendor.tfcompat import rope, config\n"
        "from myproj._vendor.tfcompat._tools import cli as _cli\n"
        "assert t.__file__.startswith(sys.argv[1]), t.__file__\n"
        "from myproj._vendor.tfcompat import _provenance\n"
        "p = _provenance.provenance()\n"
        "assert p['version'] == t.__version__ and p['made'].startswith('vendored '), p\n"
        "rc = _cli.main(['check', '--family', 'qwen2_5_vl'])\n"
        "leaked = [m for m in sys.modules if m == 'tfcompat' or m.startswith('tfcompat.')]\n"
        "assert not leaked, leaked\n"
        "sys.exit(rc)\n"
    )
    # run from tmp_path with a clean PYTHONPATH: the original package is not importable there
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "7 passed, 0 failed" in out.stdout


@BOUNDARY_ONLY
def test_vendored_copy_without_tools(tmp_path):
    """``tfcompat vendor --no-tools`` over an earlier full copy: the tools folder (and every module the earlier
    copy had that this one does not) is removed; the copy patches a model and trains a packed row exactly as
    the padded batch (a fresh interpreter that cannot import the original package), and ``python -m`` on it
    says the tools were left out (exit 2) instead of a traceback. Three interpreter starts: on the boundary
    releases."""
    dest = tmp_path / "myproj" / "_vendor" / "tfcompat"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for flags in ([], ["--no-tools"]):
        out = subprocess.run([sys.executable, "-m", "tfcompat", "vendor", str(dest), *flags], capture_output=True,
                             text=True, env=env, timeout=120)
        assert out.returncode == 0, out.stderr
    assert not (dest / "_tools").exists() and "_tools/cli.py" in out.stdout, out.stdout
    (dest / "_stale_module.py").write_text("")  # an earlier copy's module this release does not ship
    out = subprocess.run([sys.executable, "-m", "tfcompat", "vendor", str(dest), "--no-tools"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0 and not (dest / "_stale_module.py").exists(), out.stdout + out.stderr
    assert "without its tools" in (dest / "VENDORED").read_text()
    (tmp_path / "myproj" / "__init__.py").write_text("")
    code = (
        "import sys, torch\n"
        "from myproj._vendor import tfcompat as t\n"
        "from myproj._vendor.tfcompat.testing import tiny_model\n"
        "from myproj._vendor.tfcompat.packing import pack\n"
        "assert t.__file__.startswith(sys.argv[1]), t.__file__\n"
        "model = tiny_model('qwen2')\n"
        "ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]]); mask = (ids != 0).long()\n"
        "want = model(input_ids=ids, attention_mask=mask).logits[mask.bool()]\n"
        "t.patch(model)\n"
        "pk = pack(ids, mask)\n"
        "got = model(input_ids=pk.input_ids, position_ids=pk.position_ids, cu_seq_lens_q=pk.cu_seqlens,\n"
        "            max_length_q=pk.max_seqlen).logits[0]\n"
        "assert (got - want).abs().max() < 1e-4, (got - want).abs().max()\n"
        "leaked = [m for m in sys.modules if m == 'tfcompat' or m.startswith('tfcompat.')]\n"
        "assert not leaked, leaked\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    out = subprocess.run([sys.executable, "-m", "myproj._vendor.tfcompat", "report"], capture_output=True,
                         text=True, cwd=tmp_path, env=env, timeout=120)
    assert out.returncode == 2 and "without its tools" in out.stderr, out.stdout + out.stderr


def _build_wheel(setuptools, project, dist):
    """The wheel setuptools' own PEP 517 backend builds from ``project`` into ``dist`` (no network, no PYTHONPATH)."""
    build = "import os, sys, setuptools.build_meta as b\nos.chdir(sys.argv[1]); print(b.build_wheel(sys.argv[2]))\n"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", build, str(project), str(dist)], capture_output=True, text=True,
                         env=env, timeout=300)
    if out.returncode and "No module named 'wheel'" in out.stderr:
        pytest.skip(f"setuptools {setuptools.__version__} builds wheels only with the `wheel` package installed")
    assert out.returncode == 0, out.stderr[-2000:]
    return dist / out.stdout.strip().splitlines()[-1]


def test_a_wheel_holds_the_trees_modules_only(tmp_path):
    """A wheel built from the checkout holds the package's modules as the tree has them, not a module an earlier
    build left in build/lib (a module since moved: the feature folders moved 17, and tox's wheel then held both)."""
    import shutil
    import zipfile

    setuptools = pytest.importorskip("setuptools")
    repo = ROOT  # the checkout: setup.py and setup.cfg beside the package
    if not (repo / "setup.py").exists():
        pytest.skip("the tests run beside an installed package, not a checkout")
    tree = tmp_path / "tree"
    shutil.copytree(repo / "tfcompat", tree / "tfcompat", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.py", "setup.cfg", "README.md", "pyproject.toml"):
        if (repo / name).exists():
            shutil.copy(repo / name, tree / name)
    stale = tree / "build" / "lib" / "tfcompat" / "_step" / "boundaries.py"  # where 0.3.0 kept it
    stale.parent.mkdir(parents=True)
    stale.write_text("MOVED = True\n")
    names = {n for n in zipfile.ZipFile(_build_wheel(setuptools, tree, tmp_path / "dist")).namelist()
             if n.startswith("tfcompat/") and n.endswith(".py")}
    want = {p.relative_to(tree).as_posix() for p in (tree / "tfcompat").rglob("*.py")}
    assert names == want, (sorted(names - want), sorted(want - names))


def test_vendor_makes_the_parent_packages_a_wheel_needs(tmp_path):
    """`tfcompat vendor myproj/_vendor/tfcompat` in a setuptools project whose setup.py uses find_packages (as
    verl's does): the missing `_vendor/__init__.py` is made, so the built wheel holds the copy; a folder that
    already is a package keeps its own __init__.py. Built with setuptools' own PEP 517 backend, no network."""
    setuptools = pytest.importorskip("setuptools")
    project = tmp_path / "proj"
    (project / "myproj").mkdir(parents=True)
    (project / "myproj" / "__init__.py").write_text("KEEP = 1\n")
    (project / "setup.py").write_text("from setuptools import setup, find_packages\n"
                                      "setup(name='myproj', version='0.0.1', packages=find_packages())\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "tfcompat", "vendor", str(project / "myproj" / "_vendor" /
                                                                         "tfcompat")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (project / "myproj" / "_vendor" / "__init__.py").exists(), out.stdout
    assert (project / "myproj" / "__init__.py").read_text() == "KEEP = 1\n"
    assert "made " in out.stdout and str(project / "myproj" / "__init__.py") not in out.stdout
    import zipfile

    wheel = _build_wheel(setuptools, project, tmp_path / "dist")
    names = zipfile.ZipFile(wheel).namelist()
    for want in ("myproj/_vendor/__init__.py", "myproj/_vendor/tfcompat/__init__.py",
                 "myproj/_vendor/tfcompat/rope.py", "myproj/_vendor/tfcompat/_rope/native.py",
                 "myproj/_vendor/tfcompat/_provenance.py"):
        assert want in names, (want, sorted(names)[:20])
    # the wheel names the version and the commit the copy came from (VENDORED, not a module, stays behind)
    stamp = zipfile.ZipFile(wheel).read(
        "myproj/_vendor/tfcompat/_provenance.py").decode()
    assert "\nSTAMP = (" in stamp and "'vendored')" in stamp, stamp


def _vendor_layer(tmp_path, layer):
    dest = tmp_path / "proj" / "_vendor" / "tfcompat"
    out = subprocess.run([sys.executable, "-m", "tfcompat", "vendor", str(dest), "--only", layer], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert out.returncode == 0, out.stderr
    (tmp_path / "proj" / "__init__.py").write_text("")
    return dest


def _in_copy(tmp_path, code):
    """Run ``code`` in a fresh interpreter that cannot import the original package (from tmp_path, no PYTHONPATH)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ("import sys\n" + code + "\nleaked = [m for m in sys.modules if m.split('.')[0] == 'tfcompat']"
            "\nassert not leaked, leaked\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout


def test_the_rope_layer_applies_rope_from_a_config(tmp_path):
    """`vendor --only rope`: the copy holds tfcompat.rope and what it imports (no patch, no tools, no testing), and
    apply_rope(config=...) on an mRoPE family gives the original package's numbers, bit for bit."""
    import torch

    from tfcompat.rope import apply_rope
    from tfcompat.testing import tiny_model

    dest = _vendor_layer(tmp_path, "rope")
    assert not (dest / "_tools").exists() and not (dest / "testing.py").exists() and not (dest / "_step" /
                                                                                          "patch.py").exists()
    model = tiny_model("qwen2_vl")
    model.config.save_pretrained(tmp_path / "cfg")
    q, k = torch.randn(1, 4, 5, 32), torch.randn(1, 2, 5, 32)
    rotary = getattr(model.model, "language_model", model.model).rotary_emb
    cos, sin = rotary(q, torch.arange(5).view(1, 1, 5).expand(3, 1, 5))  # mRoPE: 3 position rows
    torch.save((q, k, cos, sin), tmp_path / "in.pt")
    _in_copy(tmp_path, (
        "import torch, transformers\n"
        "from proj._vendor.tfcompat.rope import apply_rope\n"
        "import proj._vendor.tfcompat as t\n"
        "config = transformers.AutoConfig.from_pretrained('cfg')\n"
        "q, k, cos, sin = torch.load('in.pt')\n"
        "torch.save(apply_rope(q, k, cos, sin, config=config), 'out.pt')\n"
        "try:\n    t.patch\nexcept AttributeError as exc:\n    assert '--only rope' in str(exc), exc\n"
        "else:\n    raise AssertionError('the rope layer has no patch')\n"))
    got = torch.load(tmp_path / "out.pt")
    want = apply_rope(q, k, cos, sin, config=model.config)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_config_layer_reads_rope_parameters(tmp_path):
    """`vendor --only config`: rope_parameters from the copy equals the original's, on a VL config."""
    from tfcompat.config import rope_parameters
    from tfcompat.testing import tiny_config

    _vendor_layer(tmp_path, "config")
    tiny_config("qwen2_5_vl").save_pretrained(tmp_path / "cfg")
    out = _in_copy(tmp_path, (
        "import transformers\n"
        "from proj._vendor.tfcompat.config import rope_parameters\n"
        "print(repr(rope_parameters(transformers.AutoConfig.from_pretrained('cfg'))))\n"))
    import transformers

    assert out.strip() == repr(rope_parameters(transformers.AutoConfig.from_pretrained(tmp_path / "cfg")))


def test_the_varlen_layer_attends_a_packed_row(tmp_path):
    """`vendor --only varlen`: the packed-attention feature (``pack`` and ``varlen_attention``) from a copy holding
    no patch, no tools and no testing; its packed attention gives the original package's numbers, bit for bit, and
    every sequence's rows equal torch's own SDPA on that sequence alone (the oracle)."""
    import torch

    from tfcompat.packing import pack
    from tfcompat.varlen import varlen_attention

    dest = _vendor_layer(tmp_path, "varlen")
    assert not (dest / "_tools").exists() and not (dest / "testing.py").exists() and not (dest / "_step" /
                                                                                          "patch.py").exists()
    torch.manual_seed(0)
    ids = torch.tensor([[5, 6, 7, 8, 9], [9, 10, 11, 0, 0]])
    mask = (ids != 0).long()
    q, k, v = (torch.randn(8, 4, 16) for _ in range(3))  # 5 + 3 real tokens
    torch.save((ids, mask, q, k, v), tmp_path / "in.pt")
    _in_copy(tmp_path, (
        "import torch\n"
        "from proj._vendor.tfcompat.packing import pack\n"
        "from proj._vendor.tfcompat.varlen import varlen_attention\n"
        "ids, mask, q, k, v = torch.load('in.pt')\n"
        "pk = pack(ids, mask)\n"
        "torch.save((pk.cu_seqlens, varlen_attention(q, k, v, pk.cu_seqlens, causal=True)), 'out.pt')\n"))
    cu, got = torch.load(tmp_path / "out.pt")
    pk = pack(ids, mask)
    assert torch.equal(cu, pk.cu_seqlens)
    assert torch.equal(got, varlen_attention(q, k, v, pk.cu_seqlens, causal=True))
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        want = torch.nn.functional.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)),
                                                                is_causal=True).transpose(0, 1)
        torch.testing.assert_close(got[a:b], want)


@BOUNDARY_ONLY
def test_the_patch_layer_trains_a_packed_row(tmp_path):
    """`vendor --only patch`: tfcompat.patch and packing from the copy; a packed row equals the padded batch on a
    model built by transformers itself, and a framework's own self-check on the copy's ``testing.tiny_model``
    (the patch layer carries testing) passes too."""
    from tfcompat.testing import tiny_config

    dest = _vendor_layer(tmp_path, "patch")
    assert (dest / "testing.py").exists() and not (dest / "_tools").exists()
    tiny_config("qwen2").save_pretrained(tmp_path / "cfg")
    _in_copy(tmp_path, (
        "import copy, torch, transformers\n"
        "from proj._vendor import tfcompat as t\n"
        "from proj._vendor.tfcompat.packing import pack\n"
        "from proj._vendor.tfcompat.testing import tiny_model\n"
        "torch.manual_seed(0)\n"
        "model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained('cfg'))\n"
        "ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]]); mask = (ids != 0).long()\n"
        "want = model(input_ids=ids, attention_mask=mask).logits[mask.bool()]\n"
        "t.patch(model)\n"
        "pk = pack(ids, mask)\n"
        "got = model(input_ids=pk.input_ids, position_ids=pk.position_ids).logits[0]\n"
        "assert (got - want).abs().max() < 1e-4, (got - want).abs().max()\n"
        "base = tiny_model('qwen3'); patched = copy.deepcopy(base); t.patch(patched)\n"
        "want = base(input_ids=ids, attention_mask=mask).logits[mask.bool()]\n"
        "got = patched(input_ids=pk.input_ids, position_ids=pk.position_ids).logits[0]\n"
        "assert (got - want).abs().max() < 1e-4, (got - want).abs().max()\n"))


def _copy_size(dest):
    files = [p for p in dest.rglob("*.py") if "__pycache__" not in p.parts]
    return len(files), sum(len(p.read_text().splitlines()) for p in files)


def test_the_readme_gives_each_layers_size(tmp_path):
    """The README's size of each `vendor --only` layer and of the whole package (files and lines of Python the copy
    holds) is what the command copies now: files exactly, lines within 2% (edits move them a little; a moved
    room moves them more)."""
    text = " ".join((ROOT / "README.md").read_text().split())
    stated = {m.group(1): (int(m.group(2)), int(m.group(3).replace(",", ""))) for m in
              re.finditer(r"`--only (rope|config|varlen|patch)` \((\d+) files, ([\d,]+) lines", text)}
    whole = re.search(r"the whole package: (\d+) files, ([\d,]+) lines", text)
    assert set(stated) == {"rope", "config", "varlen", "patch"} and whole, "the README no longer gives the sizes"
    stated["whole"] = (int(whole.group(1)), int(whole.group(2).replace(",", "")))
    got = {}
    for layer in ("rope", "config", "varlen", "patch", "whole"):
        dest = tmp_path / layer / "tfcompat"
        extra = ["--only", layer] if layer != "whole" else []
        out = subprocess.run([sys.executable, "-m", "tfcompat", "vendor", str(dest), *extra], capture_output=True,
                             text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
        assert out.returncode == 0, out.stderr
        got[layer] = _copy_size(dest)
    off = {layer: (stated[layer], got[layer]) for layer in got
           if stated[layer][0] != got[layer][0] or abs(stated[layer][1] - got[layer][1]) > 0.02 * got[layer][1]}
    assert not off, f"README (files, lines) vs the copies: {off}"
