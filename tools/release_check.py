"""The release to pin, checked as a user installs it (``tox -e release``; CI runs it in the matrix).

    python tools/release_check.py --transformers 5.25.0 [--keep DIR]

Builds the sdist and the wheel from this checkout (PEP 517, setuptools' own backend), checks their metadata
(``twine check --strict``), checks what the wheel holds (the package, its ``py.typed``, the commit stamp; no tests),
then installs the wheel in a fresh virtual environment with only torch and the named transformers and runs
``tfcompat check`` and ``tfcompat report --json`` from a folder outside the checkout. Prints PASS and exits 0, or
says what failed and exits 1.
"""

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"  # the CPU build pip and uv find beside the index (a bare torch is a multi-GB CUDA build)


def _run(argv, **kw):
    print("$", " ".join(str(a) for a in argv), flush=True)
    out = subprocess.run([str(a) for a in argv], capture_output=True, text=True, **kw)
    if out.returncode:
        print(out.stdout[-3000:], out.stderr[-3000:], sep="\n")
        raise SystemExit(f"release check: FAIL ({argv[0]} ... exited {out.returncode})")
    return out.stdout


def _version():
    text = (ROOT / "tfcompat" / "__init__.py").read_text()
    return next(line.split('"')[1] for line in text.splitlines() if line.startswith("__version__ = "))


def _commit():
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transformers", required=True, help="the transformers release to install beside it")
    parser.add_argument("--keep", help="write the sdist and wheel here (default: a temporary folder)")
    args = parser.parse_args()
    version, commit = _version(), _commit()
    work = pathlib.Path(tempfile.mkdtemp(prefix="tfcompat-release-"))
    dist = pathlib.Path(args.keep) if args.keep else work / "dist"
    try:
        _run([sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", dist, ROOT])
        wheel = dist / f"tfcompat-{version}-py3-none-any.whl"
        sdist = dist / f"tfcompat-{version}.tar.gz"
        missing = [p.name for p in (wheel, sdist) if not p.is_file()]
        if missing:
            raise SystemExit(f"release check: FAIL (the build made {sorted(os.listdir(dist))}, not {missing})")
        _run([sys.executable, "-m", "twine", "check", "--strict", wheel, sdist])
        names = zipfile.ZipFile(wheel).namelist()
        stamp = zipfile.ZipFile(wheel).read("tfcompat/_provenance.py").decode()
        problems = [want for want in ("tfcompat/__init__.py", "tfcompat/py.typed", "tfcompat/_tools/cli.py")
                    if want not in names]
        problems += [n for n in names if n.split("/")[0] in ("tests", "bench", "tools", "examples", "docs")]
        if "\nSTAMP = (" not in stamp or "'wheel')" not in stamp:
            problems.append("tfcompat/_provenance.py carries no wheel stamp")
        if problems:
            raise SystemExit(f"release check: FAIL (the wheel: {problems})")
        # a fresh environment with only torch, transformers and the wheel (uv: torch hard-linked from its cache)
        env_dir = work / "venv"
        python = env_dir / ("Scripts" if os.name == "nt" else "bin") / "python"
        uv = shutil.which("uv")
        if uv:
            _run([uv, "venv", "--quiet", "--python", sys.executable, env_dir])
            _run([uv, "pip", "install", "--quiet", "--python", python, TORCH,
                  f"transformers=={args.transformers}", wheel])
        else:
            _run([sys.executable, "-m", "venv", env_dir])
            _run([python, "-m", "pip", "install", "--quiet", TORCH, f"transformers=={args.transformers}", wheel])
        outside = work / "elsewhere"
        outside.mkdir()
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        bin_dir = python.parent
        check = _run([bin_dir / "tfcompat", "check"], cwd=outside, env=env)
        print(check.strip().splitlines()[-1] if check.strip() else "(check printed nothing)")
        doc = json.loads(_run([bin_dir / "tfcompat", "report", "--json"], cwd=outside, env=env))
        prov = doc["provenance"]
        wrong = {k: (prov.get(k), want) for k, want in (("version", version), ("commit", commit))
                 if prov.get(k) != want}
        if not prov.get("made", "").startswith("wheel"):
            wrong["made"] = (prov.get("made"), "wheel ...")
        if doc["transformers"] != args.transformers:
            wrong["transformers"] = (doc["transformers"], args.transformers)
        if wrong:
            raise SystemExit(f"release check: FAIL (the installed wheel reports (got, want): {wrong})")
        print(f"release check: tfcompat {version} (commit {commit[:12]}): sdist and wheel built, twine check passed, "
              f"the wheel installed beside {TORCH} and transformers {args.transformers} runs `tfcompat check`: PASS")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
