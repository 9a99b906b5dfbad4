"""The design card's layout: ``tfcompat/`` at the top level beside setup.cfg, setup.py, tests, tox.ini and
CHANGELOG.md, and the README's set-up command installs it so that the real package wins from any folder, the
parent of a clone folder named ``tfcompat`` included (where a plain editable install of a flat layout imports
the clone folder as an empty namespace package)."""

import os
import pathlib
import re
import shutil
import subprocess
import venv

from _helpers import ONCE

pytestmark = ONCE  # the checkout's layout and an install command: the same whatever the release

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_top_level_is_the_cards():
    for name in ("tfcompat", "tests", "setup.cfg", "setup.py", "tox.ini", "CHANGELOG.md"):
        assert (ROOT / name).exists(), f"{name} is not at the top level"
    assert (ROOT / "tfcompat" / "__init__.py").is_file()
    assert not (ROOT / "src").exists(), "the package moved to the top level; src/ is gone"


def _readme_setup_command():
    text = (ROOT / "README.md").read_text()
    found = re.search(r"```bash\n(pip install [^\n]*-e \.[^\n]*)\n```", text)
    assert found, "the README's set-up command (pip install ... -e . ...) is not in a bash block"
    return found.group(1).split("&&")[0].strip()


def test_the_readme_installs_so_that_a_clone_folder_named_tfcompat_shadows_nothing(tmp_path):
    command = _readme_setup_command()
    assert "editable_mode=compat" in command, command
    parent = tmp_path / "work"
    clone = parent / "tfcompat"  # a clone folder named after the package, as `git clone .../tfcompat` makes
    shutil.copytree(ROOT, clone, ignore=shutil.ignore_patterns(".tox", ".git", "build", "dist", "*.egg-info",
                                                               "__pycache__", ".hypothesis", ".pytest_cache"))
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / ("Scripts" if os.name == "nt" else "bin") / "python"
    # the README's command, without torch (this venv only imports the package, which imports no torch) and
    # without dependencies (nothing to download but the build backend)
    args = [a for a in command.split()[2:] if not a.startswith("torch")]
    out = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", *args], cwd=clone,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    probe = ("import importlib.util, tfcompat; spec = importlib.util.find_spec('tfcompat'); "
             "print(spec.origin); print(tfcompat.__version__)")
    out = subprocess.run([str(python), "-c", probe], cwd=parent, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    origin, version = out.stdout.split()
    assert pathlib.Path(origin) == clone / "tfcompat" / "__init__.py", origin
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), version

