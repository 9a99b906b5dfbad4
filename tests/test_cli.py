"""The command as a user runs it: subprocesses, exit codes, JSON schema."""

import json
import os
import subprocess
import sys

import pytest

from _helpers import BOUNDARY_ONLY, ONCE, installed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python(*argv, cwd=None, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=cwd or ROOT, env=env,
                          timeout=timeout)


def run(*args, cwd=None, timeout=300):
    return python("-m", "tfcompat", *args, cwd=cwd, timeout=timeout)


@pytest.mark.parametrize("command", [[], ["report"], ["check"], ["vendor"]])
def test_help(command):
    out = run(*command, "--help")
    assert out.returncode == 0 and "usage: tfcompat" in out.stdout


def test_report_json_schema():
    out = run("report", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads(out.stdout)
    assert doc["schema"] == 1 and doc["error"] is None
    assert {"tfcompat", "python", "torch", "transformers", "flash_attn", "supported_range", "families",
            "resolutions"} <= set(doc)
    assert set(doc["families"]) == set(installed())
    caps = {r["capability"] for r in doc["resolutions"]}
    assert {f"rope.apply:{n}" for n in installed()} <= caps
    for r in doc["resolutions"]:
        assert set(r) == {"capability", "impl", "source", "reason", "transformers", "plan"}
    # the summary: what a reader needs first, counted from the decisions below it
    summary = doc["summary"]
    assert set(summary) == {"release", "kernels", "carrier", "families", "unsupported"}
    assert summary["families"].startswith(f"{len(installed())} on this release: ")
    assert doc["transformers"] in summary["release"] and summary["unsupported"] == "none"
    backend = next(r["impl"] for r in doc["resolutions"] if r["capability"] == "varlen.backend")
    assert backend in summary["kernels"]
    assert doc["provenance"]["version"] == doc["tfcompat"]


def test_report_text():
    out = run("report")
    assert out.returncode == 0
    assert "transformers" in out.stdout and "rope.apply:qwen2_vl" in out.stdout
    lines = out.stdout.splitlines()
    assert lines[0].startswith("tfcompat ") and "(commit " in lines[0]
    # the summary block comes before the decisions it sums up
    assert lines.index("summary:") < min(i for i, line in enumerate(lines) if line.startswith("rope.apply:"))
    wide = [line for line in out.stdout.splitlines() if len(line) > 100]
    assert not wide, f"report lines wider than 100 columns: {wide[:2]}"


def test_check_all_families_json(capsys):
    """Every family (in process: test_check_unknown_family and test_help run the command itself)."""
    code, out = check_here(capsys, "--json")
    assert code == 0, out[-3000:]
    doc = json.loads(out)
    assert doc["passed"] is True and set(doc["families"]) == set(installed())
    for r in doc["results"]:
        assert set(r) == {"family", "check", "compares", "max_abs_diff", "tolerance", "passed", "skipped",
                          "seconds", "error"}
        assert r["passed"] and (r["skipped"] is not None or r["max_abs_diff"] <= r["tolerance"])
    # every family lists every check, run or skipped with the reason
    checks = {r["check"] for r in doc["results"]}
    for name in installed():
        mine = [r for r in doc["results"] if r["family"] == name]
        assert {r["check"] for r in mine} == checks, name
        assert all(r["skipped"] or r["compares"] in ("fwd", "fwd+bwd", "values") for r in mine)


def check_here(capsys, *args):
    """`tfcompat check ...` in this process (the subprocess runs above prove the command itself; these save
    the seconds of importing torch and transformers again)."""
    from tfcompat._tools import cli as _cli  # private: the command, run in process

    capsys.readouterr()
    code = _cli.main(["check", *args])
    return code, capsys.readouterr().out


def test_check_text_table_and_summary(capsys):
    """The summary block first (the imports' time apart from the checks', what passed per check, the legend); the
    table of one line per check only with --verbose; the closing count last."""
    code, out = check_here(capsys, "--family", "qwen2_vl")
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[0].startswith("tfcompat check: ") and lines[1].startswith("time: imports ")
    assert lines[2] == "summary: 7 passed, 0 failed, 0 skipped"
    assert "rope.native.fp32 (1)" in out and any(line.startswith("legend: ") for line in lines)
    assert not any(line.startswith("  [") for line in lines), "the table without --verbose"
    assert lines[-1].startswith("7 passed, 0 failed, 0 skipped (1 family,")
    assert not [line for line in lines if len(line) > 100]
    code, verbose = check_here(capsys, "--family", "qwen2_vl", "--verbose")
    table = [line for line in verbose.splitlines() if line.startswith("  [ok  ] qwen2_vl ")]
    assert code == 0 and len(table) == 7 and verbose.index("summary:") < verbose.index("  [ok  ]")


def test_check_summary_groups_the_skips_by_reason(capsys):
    """Every skipped check is counted under its reason, with the families and checks it covers."""
    from tfcompat.testing import families

    FAMILIES = families(installed_only=False)

    names = [n for n in installed() if not FAMILIES[n].vision][:2]
    code, out = check_here(capsys, *[a for n in names for a in ("--family", n)], "--json")
    skipped = [r for r in json.loads(out)["results"] if r["skipped"]]
    code, out = check_here(capsys, *[a for n in names for a in ("--family", n)])
    assert code == 0 and skipped
    text = " ".join(out.split())
    for reason in {r["skipped"] for r in skipped}:
        count = sum(r["skipped"] == reason for r in skipped)
        fams = ", ".join(dict.fromkeys(r["family"] for r in skipped if r["skipped"] == reason))
        assert f"{count} x {' '.join(reason.split())} [{fams}: " in text, (reason, out)


def test_check_fails_on_a_wrong_tolerance(capsys):
    code, out = check_here(capsys, "--family", "qwen2_vl", "--tolerance", "-1")
    assert code == 1
    assert "0 passed, 7 failed" in out
    # a failed check's line is printed without --verbose
    assert len([line for line in out.splitlines() if line.startswith("  [FAIL] qwen2_vl ")]) == 7


def test_check_says_why_a_check_does_not_apply(capsys):
    """A family whose checks do not all apply: exit 0, one line per check, the reason on each skipped one."""
    from tfcompat.testing import families

    FAMILIES = families(installed_only=False)

    name = next((n for n in installed() if FAMILIES[n].nope), None) or next(
        n for n in installed() if not FAMILIES[n].vision)
    code, out = check_here(capsys, "--family", name, "--verbose")
    assert code == 0, out
    lines = [line for line in out.splitlines() if line.startswith("  [")]
    assert len(lines) == 7
    skipped = [line for line in lines if line.startswith("  [skip]")]
    assert skipped and all(len(line.split(None, 4)) == 5 for line in skipped), skipped
    if FAMILIES[name].nope:
        assert "NoPE" in out


@pytest.mark.parametrize("command", [["report"], ["report", "--json"]])
@ONCE  # the command's plumbing
def test_output_survives_a_closed_pipe(command):
    """`tfcompat report | head -1`: no traceback when the reader leaves."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = " ".join([sys.executable, "-m", "tfcompat", *command])
    out = subprocess.run(f"{argv} | head -1", shell=True, capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=120)
    assert out.stdout and "Traceback" not in out.stderr and "BrokenPipeError" not in out.stderr, out.stderr


def test_check_unknown_family():
    out = run("check", "--family", "gpt2")
    assert out.returncode == 2
    assert "does not cover model_type 'gpt2'" in out.stderr


@ONCE  # the command's plumbing
def test_vendor_refuses_foreign_folder_and_symlinks(tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    out = run("vendor", str(foreign))
    assert out.returncode == 2 and "is not an earlier tfcompat copy" in out.stderr
    assert sorted(os.listdir(foreign)) == ["keep.txt"]

    outside = tmp_path / "outside"
    outside.mkdir()
    link = tmp_path / "link"
    link.symlink_to(outside)
    out = run("vendor", str(link))
    assert out.returncode == 2 and "symlink" in out.stderr
    assert os.listdir(outside) == []

    # a symlinked subfolder inside an earlier copy would make writes escape DEST
    dest = tmp_path / "copy"
    assert run("vendor", str(dest)).returncode == 0
    import shutil

    shutil.rmtree(dest / "_kernels")
    (dest / "_kernels").symlink_to(outside)
    out = run("vendor", str(dest))
    assert out.returncode == 2 and "escape" in out.stderr
    assert os.listdir(outside) == []


@ONCE  # the command's plumbing
def test_vendor_overwrites_an_earlier_copy_and_force(tmp_path):
    dest = tmp_path / "v" / "tfcompat"
    out = run("vendor", str(dest))
    assert out.returncode == 0 and "copied tfcompat" in out.stdout
    marker = (dest / "VENDORED").read_text()
    assert marker.startswith("tfcompat ") and "\ncommit " in marker
    # no machine path lands in the repositories that vendor tfcompat
    assert ROOT not in marker and os.sep + "tmp" not in marker and not any(
        word.startswith(os.sep) for word in marker.split()), marker
    assert run("vendor", str(dest)).returncode == 0
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "x").write_text("x")
    assert run("vendor", str(foreign), "--force").returncode == 0
    assert (foreign / "x").exists() and (foreign / "rope.py").exists()


@ONCE  # the command's plumbing
def test_report_imports_neither_transformers_nor_torch():
    """What keeps ``tfcompat report`` within a few seconds: every decision is read from transformers' files.
    torch is imported only where triton or flash-attn is installed (whether those import is the decision)."""
    from tfcompat._probe import backends as _backends  # private: the kernel choice is under test

    code = ("import sys; from tfcompat._tools import cli as _cli; rc = _cli.main(['report']); "
            "print('HEAVY', sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'})); "
            "sys.exit(rc)")
    out = python("-c", code)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    heavy = out.stdout.rsplit("HEAVY", 1)[1].strip()
    torch_needed = _backends.installed("triton") or _backends.installed("flash_attn")
    assert heavy == ("['torch']" if torch_needed else "[]"), heavy


def test_report_output_to_a_folder_or_an_unwritable_path(tmp_path, capsys):
    """`--output` names a file: a folder, or a path that cannot be written, gets one line and exit 2."""
    from tfcompat._tools.cli import main  # private: the command, run in process

    assert main(["report", "--output", str(tmp_path)]) == 2
    assert "is a directory; pass a file path, e.g." in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["report", "--output", str(blocker / "report.json")]) == 2
    assert "cannot write --output" in capsys.readouterr().err
    capsys.readouterr()
    assert main(["report", "--output", str(tmp_path / "new" / "report.json")]) in (0, None)
    written = json.loads((tmp_path / "new" / "report.json").read_text())["resolutions"]
    assert written
    # the log (tox runs this command in every environment) keeps the summary; the decisions are in the file
    out = capsys.readouterr().out
    assert "summary:" in out and f"{len(written)} decisions written to" in out
    assert "decisions (capability" not in out and len(out.splitlines()) < 30, out


@ONCE  # the command's plumbing
def test_check_device_cuda_refuses_in_one_line_without_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: the refusal is for machines without one")
    out = run("check", "--device", "cuda")
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device is visible" in lines[0] and "tfcompat check" in lines[0]


def test_check_device_plan_names_the_kernels_it_would_prove(capsys):
    """--plan needs no device: the kernels auto picks on CUDA here (from the kernel table) and the checks."""
    from tfcompat._probe import backends as _backends  # private: the kernel choice is under test

    code, out = check_here(capsys, "--device", "cuda", "--plan", "--family", "qwen2")
    assert code == 0
    rope, attn = _backends.select("rope", "cuda"), _backends.select("varlen", "cuda", "bfloat16")
    assert f"rope: {rope}" in out and f"packed attention (bf16): {attn}" in out
    assert f"rope.{rope}.bf16.vs_cpu_fp32" in out and f"varlen.{attn}.bf16" in out and "attention.packed.fp32" in out
    assert ("proves itself on first use" in out) == (rope == "triton" or attn != "sdpa")


@BOUNDARY_ONLY  # the checks themselves run in every environment through plain `check`
def test_check_device_runs_the_shared_checks(capsys):
    """--device cpu runs the device path (the one --device cuda runs) here: the same packed == padded check, with
    the same seeds, gives exactly the plain check's number; speed lines side by side; exit 0."""
    code, out = check_here(capsys, "--device", "cpu", "--dtype", "bf16", "--family", "qwen2_vl", "--json")
    assert code == 0, out
    doc = json.loads(out)
    by = {r["check"]: r for r in doc["results"]}
    assert set(by) == {"rope.native.bf16", "rope.native.bf16.inplace", "rope.native.bf16.vs_cpu_fp32",
                       "attention.packed.fp32", "varlen.sdpa.bf16"} and doc["passed"]
    assert set(doc["speed_ms"]) == {"rope native", "rope upstream", "copy q, k"}
    code, plain = check_here(capsys, "--family", "qwen2_vl", "--json")
    same = next(r for r in json.loads(plain)["results"] if r["check"] == "attention.packed")
    assert by["attention.packed.fp32"]["max_abs_diff"] == same["max_abs_diff"]
    code, out = check_here(capsys, "--device", "cpu", "--family", "qwen2_vl", "--tolerance", "-1")
    assert code == 1 and "FAIL" in out


@ONCE  # the script's plumbing
def test_gpu_check_script_runs_and_refuses_without_a_gpu():
    """bench/gpu_check.py, the one prepared GPU script, runs its main (it once ended without calling it: exit 0,
    nothing checked); on a machine without CUDA it says so and exits 2."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: run the script itself")
    out = python(os.path.join("bench", "gpu_check.py"))
    assert out.returncode == 2 and "no CUDA device" in out.stdout


def test_check_json_is_the_only_thing_on_stdout(capsys):
    """`check --json`: whatever runs inside prints to stderr, not into the document (DeepSpeed, imported by
    transformers while loading a model, logged a line on stdout before the JSON). A global forward hook (torch's
    own API) prints during every forward of the checks."""
    import torch

    def chatty(module, args):
        if module.__class__.__name__.endswith("ForCausalLM"):
            print("[WARNING] a library's line on stdout")

    handle = torch.nn.modules.module.register_module_forward_pre_hook(chatty)
    try:
        code, out = check_here(capsys, "--family", installed()[0], "--json")
    finally:
        handle.remove()
    assert code == 0 and json.loads(out)["passed"], out[:300]


@pytest.mark.parametrize("device", ["gpu", "CPU", "garbage", "cuda:abc", "mps", "meta", "xpu", " cpu"])
@pytest.mark.parametrize("plan", [False, True], ids=["run", "plan"])
def test_check_device_an_unsupported_device_gets_one_line(device, plan, capsys):
    """A device string torch does not parse printed torch's raw RuntimeError (whose list suggests mps or meta);
    --plan printed a plan for mps and meta. Every one gets the same line, exit 2, in both modes."""
    capsys.readouterr()
    from tfcompat._tools import cli as _cli  # private: the command, run in process

    code = _cli.main(["check", "--device", device, "--family", "qwen2"] + (["--plan"] if plan else []))
    out = capsys.readouterr()
    lines = [ln for ln in out.err.splitlines() if ln.strip()]
    assert code == 2 and out.out == "" and len(lines) == 1, (out.out, out.err)
    assert "tfcompat check runs on cpu or cuda" in lines[0] and "Traceback" not in out.err, lines[0]


def test_check_device_line_names_the_kernel_that_ran():
    """`check --device cuda` names each line after the kernel the plan picks, but its checks call impl="auto": a
    kernel that fails its first-use proof hands the call to the proven path, and the line used to read ok. Here a
    stand-in kernel made to fail its proof during the check: the line names the fallback that ran and fails, with
    the proof's reason; a stand-in that passes keeps the plan's name and passes."""
    import warnings

    import torch

    import tfcompat
    from tfcompat._kernels import table  # private: the kernel and proof table is under test
    from tfcompat._tools import check_cmd, device_checks  # private: the command's pure decisions

    def check_with(factor):
        def fn():
            def kernel():
                return (torch.ones(3) * factor,)

            def proven():
                return (torch.ones(3),)

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                table.first_use("rope", "triton", "cpu", ("stand-in",), kernel, proven, False)
            return 0.0  # the proven path computed the numbers: they agree with the oracle
        return device_checks._one("qwen2", "rope.triton.bf16", fn, None, 1e-2, "fwd+bwd", ("rope", "triton"))

    tfcompat.clear_cache()
    good = check_with(1.0)
    assert good["passed"] and good["check"] == "rope.triton.bf16" and good["error"] is None, good
    tfcompat.clear_cache()
    bad = check_with(2.0)
    assert not bad["passed"] and bad["check"] == "rope.composite(fallback from triton).bf16", bad
    assert "failed its first-use proof" in bad["error"] and "composite path ran instead" in bad["error"], bad
    line = check_cmd._check_line(bad, 8)
    assert "[FAIL]" in line and "fallback from triton" in line and "first-use proof" in line, line
    tfcompat.clear_cache()
