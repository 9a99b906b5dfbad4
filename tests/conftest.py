import os
import warnings

import pytest


def pytest_sessionstart(session):
    """Fail the whole run if tox handed us another transformers than the env declares."""
    expected = os.environ.get("TFCOMPAT_EXPECT_TRANSFORMERS")
    import importlib.metadata
    import importlib.util

    installed = importlib.metadata.version("transformers")
    torch_version = importlib.metadata.version("torch")
    print(f"\ntfcompat tests: transformers {installed}, torch {torch_version}, expected {expected or '(any)'}")
    if expected and expected != "latest" and installed != expected:
        pytest.exit(f"tox env expects transformers {expected} but {installed} is installed", returncode=3)
    want_torch = os.environ.get("TFCOMPAT_EXPECT_TORCH")
    if want_torch and torch_version.split("+")[0] != want_torch:
        pytest.exit(f"tox env expects torch {want_torch} but {torch_version} is installed", returncode=3)
    clients = os.environ.get("TFCOMPAT_EXPECT_CLIENTS", "").split()
    missing = [c for c in clients if importlib.util.find_spec(c) is None]
    if missing:
        pytest.exit(f"tox env expects the clients {clients} installed, but {missing} are not", returncode=3)
    if os.environ.get("TFCOMPAT_EXPECT_TRITON"):
        from _helpers import triton_ready

        if not triton_ready():
            pytest.exit("tox env expects the Triton kernels to run in Triton's interpreter, but triton does not "
                        "import or TRITON_INTERPRET is unset", returncode=3)


@pytest.fixture(autouse=True)
def _quiet_upstream_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        yield
