import importlib.metadata
import os
import subprocess
import sys

import pytest
from packaging.version import Version

from tfcompat import version


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
