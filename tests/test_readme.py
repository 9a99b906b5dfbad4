"""Every code block of the README and of docs/ runs as written, and so does every script in examples/ (as a newcomer
runs them): Python blocks are executed, the blocks that show an example script equal that script and the script
runs under torchrun, and the shell blocks name commands, files, flags and extras that exist. Each README block
and each example ends with its comparison: it prints PASS and exits 0, and a copy with its tolerance made negative
prints FAIL and exits 1 (a comparison that cannot fail would prove nothing)."""

import configparser
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from _helpers import COMPILES, ONCE, SPAWNED_RANKS, installed

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks(kind):
    out = []
    for page in PAGES:
        for n, block in enumerate(re.findall(rf"```{kind}\n(.*?)```", page.read_text(), re.S)):
            out.append(pytest.param(block, id=f"{page.relative_to(ROOT)}-{n}"))
    return out


PYTHON = _blocks("python")
SHELL = _blocks("bash")
#: a block that shows an example script run by torchrun starts with its command line
TORCHRUN = re.compile(r"# torchrun --nproc_per_node (\d+) (examples/\S+\.py)")
SPAWNS = SPAWNED_RANKS  # the examples over spawned ranks
# the torchrun examples as written: with the newest release (tf525; tf451-torch27 leaves this module out); the
# other spawning environments (tf457, tf451-torch27) run the same code through the spawned-rank tests
# (tests/test_distributed.py, tests/test_trainer_sp.py), which compare numbers, not only exit codes
EXAMPLES_EDGES = pytest.mark.skipif(os.environ.get("TFCOMPAT_EXAMPLE_TESTS") == "skip",
                                    reason="the torchrun examples run with the newest release (tox.ini)")


def _needs(block):
    if "qwen2_vl" in block and "qwen2_vl" not in installed():
        pytest.skip("not in this release")
    if "transformers.Trainer" in block or "TrainingArguments" in block:
        pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (the tox envs install it)")
    if re.search(r"^import .*\btrl\b", block, re.M):
        pytest.importorskip("trl", reason="TRL 1.x: the tox envs of transformers >= 4.56.2 install it")
        pytest.importorskip("peft")


def _run_block(block, name):
    """exec a whole program; its exit status (SystemExit's code, 0 when it ends without one)."""
    try:
        exec(compile(block, name, "exec"), {"__name__": "__main__"})
    except SystemExit as exc:
        return exc.code or 0
    return 0


def test_the_pages_have_runnable_examples():
    readme = [p for p in PYTHON if p.id.startswith("README.md-")]
    assert len(readme) >= 3 and len(PYTHON) >= 12
    for p in PYTHON:
        block = p.values[0]
        code = re.sub(r"\A(#[^\n]*\n)+", "", block)  # a block may open with the install line it needs
        assert code.startswith("import ") or TORCHRUN.match(block), f"{p.id}: not a whole program"
        extra = re.match(r"# pip install -e '\.\[(\w+)\]'", block)
        if extra:
            assert extra.group(1) in _extras(), f"{p.id}: no extra {extra.group(1)!r} in setup.cfg"
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 300, f"the README has {lines} lines; the rest belongs in docs/"


@pytest.mark.parametrize("block", [pytest.param(*p.values, id=p.id, marks=COMPILES) if "torch.compile(" in p.values[0]
                                   else p for p in PYTHON if not TORCHRUN.match(p.values[0])])
def test_python_block_runs_as_written(block, capsys, request):
    """Each block runs, prints PASS where it compares, and warns no FutureWarning (a deprecated name): none at all
    from a README block; none from a docs block's own lines (TRL 1.16 itself warns on 5.24 about the
    `gradient_checkpointing` its SFTConfig sets by default)."""
    import warnings

    _needs(block)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FutureWarning)
        assert _run_block(block, "block") == 0, capsys.readouterr().out[-2000:]
    readme = request.node.callspec.id.startswith("README.md-")
    future = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if issubclass(w.category, FutureWarning)
              and (readme or w.filename == "block")]
    assert not future, future
    if "TOL = " in block:
        assert "PASS" in capsys.readouterr().out


def _sabotaged(text):
    """The program with every tolerance negative: its comparison must now fail."""
    out, n = re.subn(r"^TOL = .*$", "TOL = -1.0", text, flags=re.M)
    assert n == 1, "a comparing example names its tolerance once: TOL = ..."
    return out


@pytest.mark.parametrize("block", [p if p.id.startswith("README.md-") else pytest.param(*p.values, id=p.id, marks=ONCE)
                                   for p in PYTHON if not TORCHRUN.match(p.values[0])])
def test_every_block_ends_with_a_comparison_that_can_fail(block, capsys):
    """Every Python block of the README and of docs/ compares with the unpatched model or upstream's own function,
    prints the number and PASS, and exits 1 printing FAIL when its tolerance is made negative."""
    assert "TOL = " in block and "PASS" in block and "SystemExit(0 if" in block, "a block proves itself"
    _needs(block)
    assert _run_block(_sabotaged(block), "sabotaged block") == 1
    assert "FAIL" in capsys.readouterr().out


def _torchrun(script, ranks, tmp_path, text=None):
    path = ROOT / script
    if text is not None:
        path = tmp_path / path.name
        path.write_text(text)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(ranks), str(path)], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=600)


@pytest.mark.parametrize("block", [p for p in PYTHON if TORCHRUN.match(p.values[0])])
def test_a_shown_example_is_the_script_itself(block):
    script = TORCHRUN.match(block).group(2)
    assert block.strip() == (ROOT / script).read_text().strip(), f"the page shows another {script}"


EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))


@pytest.mark.xdist_group("examples")
@SPAWNS
@EXAMPLES_EDGES
@pytest.mark.parametrize("script,ranks", [("examples/verl_ulysses.py", 2), ("examples/trainer_sp_cpu.py", 4)])
def test_the_torchrun_examples_pass(script, ranks, tmp_path):
    text = (ROOT / script).read_text()
    if "qwen2_5_vl" in text and "qwen2_5_vl" not in installed():
        pytest.skip("not in this release")
    if "transformers" in text and "Trainer" in text:
        pytest.importorskip("accelerate")
    out = _torchrun(script, ranks, tmp_path)
    assert out.returncode == 0 and "PASS" in out.stdout and "FAIL" not in out.stdout, out.stdout + out.stderr[-3000:]


@pytest.mark.xdist_group("examples")
@SPAWNS
@ONCE  # the comparison's own code, the same on every release
def test_a_torchrun_example_fails_on_a_mismatch(tmp_path):
    """The sabotaged copy (its TOL made negative) of the cheaper torchrun example prints FAIL and exits non-zero."""
    script = "examples/verl_ulysses.py"
    text = (ROOT / script).read_text()
    if "qwen2_5_vl" not in installed():
        pytest.skip("not in this release")
    out = _torchrun(script, 2, tmp_path, _sabotaged(text))
    assert out.returncode != 0 and "FAIL" in out.stdout, out.stdout + out.stderr[-3000:]


def test_every_example_is_run_here():
    assert set(EXAMPLES) == {"vl_training_step.py", "verl_ulysses.py", "trainer_sp_cpu.py"}, \
        "an example no test runs"


def _run_example(argv, capsys, text=None):
    import runpy

    saved = sys.argv
    sys.argv = [str(ROOT / "examples" / "vl_training_step.py"), *argv]
    try:
        if text is None:
            with pytest.raises(SystemExit) as exit_:
                runpy.run_path(sys.argv[0], run_name="__main__")
        else:
            with pytest.raises(SystemExit) as exit_:
                exec(compile(text, sys.argv[0], "exec"), {"__name__": "__main__"})
    finally:
        sys.argv = saved
    return exit_.value.code, capsys.readouterr().out


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_the_vl_training_step_example(family, capsys):
    """As `python examples/vl_training_step.py FAMILY` runs it (as __main__, with that argv), in this process:
    torch and transformers are imported already."""
    if family not in installed():
        pytest.skip("not in this release")
    code, out = _run_example([family], capsys)
    assert code == 0 and out.count("PASS") == 2 and "every vision weight has a gradient" in out, out
    code, out = _run_example([family], capsys, _sabotaged((ROOT / "examples" / "vl_training_step.py").read_text()))
    assert code == 1 and "FAIL" in out, out


@pytest.mark.parametrize("family", ["qwen3", "glm_image", "gpt2"])
def test_the_example_explains_a_family_it_cannot_train(family, capsys):
    """A text-only family, a family patch refuses, an unknown name: one line saying why, no traceback."""
    if family != "gpt2" and family not in installed():
        pytest.skip("not in this release")
    code, _ = _run_example([family], capsys)
    assert isinstance(code, str) and code.startswith("vl_training_step: "), code


# ------------------------------------------------------------------------------------------------- shell blocks
def _extras():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return set(cfg["options.extras_require"])


def _tox_envs():
    text = (ROOT / "tox.ini").read_text()
    listed = re.search(r"envlist = (.*?)\nskip_missing", text, re.S).group(1)
    envs = set()
    for item in re.split(r",\s*(?![^{]*\})", " ".join(listed.split())):
        m = re.fullmatch(r"([a-z0-9]*)\{([^}]*)\}(.*)", item.strip())
        envs |= {m.group(1) + x.strip() + m.group(3) for x in m.group(2).split(",")} if m else {item.strip()}
    return envs | {"tflatest"}


@pytest.mark.parametrize("block", SHELL)
def test_shell_block_names_what_exists(block):
    """Each command line of a shell block: `tfcompat ...` parses with the command's own parser; a script run by
    python or torchrun exists; an extra installed exists in setup.cfg; `tox -e ENV` names an environment."""
    from tfcompat._tools.cli import build_parser  # private: the command's own parser checks the shell blocks

    parser = build_parser()
    checked = 0
    for raw in block.splitlines():
        line = re.split(r"\s#", raw)[0].strip()
        if not line or line.startswith(("#", "export ", "...")):
            continue
        for command in re.split(r"\s*&&\s*", line):
            words = shlex.split(command.replace("[", "").replace("]", "")) if "'" in command or '"' in command \
                else command.replace(" [", " ").replace("]", "").split()
            if words[0] == "tfcompat":
                args = [w if not w.isupper() else "x" for w in words[1:] if not w.startswith("|")]
                try:
                    parser.parse_args([a for a in args if a != "|"])
                except SystemExit:
                    pytest.fail(f"`{command}` does not parse")
            elif words[0] in ("python", "torchrun"):
                script = next(w for w in words[1:] if w.endswith(".py"))
                assert (ROOT / script).is_file(), f"`{command}`: no {script}"
            elif words[0] == "pip":
                for extras in re.findall(r"\.\[([a-z,]+)\]", command):
                    assert set(extras.split(",")) <= _extras(), f"`{command}`: extras setup.cfg does not define"
            elif words[0] == "tox" and "-e" in words:
                assert words[words.index("-e") + 1] in _tox_envs(), f"`{command}`: no such tox environment"
            elif words[0] not in ("tox", "pytest", "git", "cd"):
                pytest.fail(f"`{command}`: a command this test does not know")
            checked += 1
    assert checked, "a shell block with no command"
