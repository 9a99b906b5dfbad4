import importlib.metadata
import os
import subprocess
import sys

import pytest
from packaging.version import Version

from tfcompat import version

from _helpers import ONCE


def test_tox_env_got_the_transformers_it_declares():
    expected = os.environ.get("TFCOMPAT_EXPECT_TRANSFORMERS")
    if not expected:
        pytest.skip("not run under tox")
    installed = importlib.metadata.version("transformers")
    if expected == "latest":
        print(f"canary: newest transformers is {installed}")
        return
    assert installed == expected


def test_version_is_read_from_metadata():
    assert version.transformers_version() == Version(Version(importlib.metadata.version("transformers")).base_version)


def test_prerelease_policy():
    assert version._normalize("5.0.0rc0") == Version("5.0.0")
    assert version._normalize("5.0.0.dev0") == Version("5.0.0")
    assert version._normalize("4.57.6+local") == Version("4.57.6")
    with pytest.raises(ValueError, match="not a version"):
        version._normalize("five")


def test_range_bounds_are_inclusive_and_parsed():
    v = str(version.transformers_version())
    assert version.is_transformers_version_in_range(v, v)
    assert version.is_transformers_version_in_range()
    assert version.is_transformers_version_in_range(min_version="4.9")  # "4.9" < "4.51" as versions
    assert not version.is_transformers_version_in_range(max_version="4.9")
    assert not version.is_transformers_version_in_range(min_version="99.0")


def test_import_is_pure_and_cheap():
    code = (
        "import sys, time; t = time.perf_counter(); import tfcompat, tfcompat.rope, tfcompat.config, "
        "tfcompat.errors, tfcompat.version, tfcompat.testing; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, "
        "[m for m in sys.modules if m.startswith(('torch', 'transformers'))][:5]; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_version_literal():
    import tfcompat

    assert Version(tfcompat.__version__)


@ONCE  # a wheel's stamp: the same on every release
def test_the_package_names_its_version_and_the_commit_it_came_from():
    """0.3.0, and the commit: read live in a checkout (editable install), stamped into a wheel built from it (tox
    builds one: `package = wheel`); `report` prints both on its first line and in its JSON."""
    import json

    import tfcompat
    from tfcompat import _provenance

    assert tfcompat.__version__ == "0.3.0"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except OSError:
        head = ""
    if len(head) != 40:
        pytest.skip("the tests do not run in a git checkout")
    got = _provenance.provenance()
    assert got["version"] == "0.3.0", got
    assert got["commit"] == head, (f"the installed tfcompat ({got['made']}) names commit {got['commit']}, this "
                                   f"checkout is at {head}: a stale install (reinstall it), or the stamp is wrong")
    assert got["made"] == "checkout" or got["made"].startswith("wheel "), got
    out = subprocess.run([sys.executable, "-m", "tfcompat", "report", "--json"], capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(root))
    assert json.loads(out.stdout)["provenance"] == got
    first = subprocess.run([sys.executable, "-m", "tfcompat", "report"], capture_output=True, text=True,
                           timeout=120, cwd=os.path.dirname(root)).stdout.splitlines()[0]
    assert first.startswith(f"tfcompat 0.3.0 (commit {head[:12]}"), first
