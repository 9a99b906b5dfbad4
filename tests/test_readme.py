"""The README's examples run as written, and so do examples/ (as a newcomer runs them)."""

import pathlib
import re
import sys

import pytest

from _helpers import installed

ROOT = pathlib.Path(__file__).resolve().parents[1]
# every Python block of the README is a complete program
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_the_readme_has_runnable_examples():
    assert len(BLOCKS) >= 8
    assert all(b.startswith("import ") for b in BLOCKS), "a README block that is not a whole program"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs_as_written(index):
    if "qwen2_vl" in BLOCKS[index] and "qwen2_vl" not in installed():
        pytest.skip("not in this release")
    if "transformers.Trainer" in BLOCKS[index]:
        pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (the tox envs install it)")
    if "import tfcompat, torch, trl" in BLOCKS[index]:
        pytest.importorskip("trl", reason="TRL 1.x: the tox envs of transformers >= 4.56.2 install it")
        pytest.importorskip("peft")
    exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), {})


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_the_vl_training_step_example(family, capsys):
    """The example as `python examples/vl_training_step.py FAMILY` runs it (as __main__, with that argv), in
    this process: torch and transformers are imported already."""
    import runpy

    if family not in installed():
        pytest.skip("not in this release")
    argv = sys.argv
    sys.argv = [str(ROOT / "examples" / "vl_training_step.py"), family]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        sys.argv = argv
    assert "every vision weight has a gradient" in capsys.readouterr().out


@pytest.mark.parametrize("family", ["qwen3", "glm_image", "gpt2"])
def test_the_example_explains_a_family_it_cannot_train(family):
    """A text-only family, a family patch refuses, an unknown name: one line saying why, no traceback."""
    import runpy

    if family != "gpt2" and family not in installed():
        pytest.skip("not in this release")
    argv = sys.argv
    sys.argv = [str(ROOT / "examples" / "vl_training_step.py"), family]
    try:  # in this process: the script exits before any training, so a subprocess would only add imports
        with pytest.raises(SystemExit) as exit_:
            runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        sys.argv = argv
    assert isinstance(exit_.value.code, str) and exit_.value.code.startswith("vl_training_step: "), exit_.value
