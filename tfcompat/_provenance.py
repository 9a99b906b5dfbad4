"""Where this copy of the package came from: its version and the git commit it was built or copied from.

``tfcompat vendor`` rewrites this file in the copy it makes, and a wheel build stamps it (``setup.py``), so a
vendored copy or a wheel names its commit after it has left the repository; a git checkout is read live.
Imports nothing of the package (the version is read from the package object, always loaded first).
"""

import functools
import os

#: set in a vendored copy or a built wheel: (commit, date, how it was made); None in the repository itself
STAMP = None


@functools.lru_cache(maxsize=None)
def _checkout_commit(package_dir):
    """The commit of the checkout this package folder sits in (``tfcompat/`` at the top of tfcompat's own
    repository, beside ``setup.cfg``), or None: never the commit of some other repository a copy happens to lie in."""
    import subprocess

    root = os.path.dirname(package_dir)
    try:
        with open(os.path.join(root, "setup.cfg")) as fh:
            if "\nname = tfcompat\n" not in fh.read():
                return None  # another project's checkout that holds a copy
    except OSError:
        return None
    try:
        out = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.split()
    if out.returncode or len(lines) != 2 or os.path.realpath(lines[0]) != os.path.realpath(root):
        return None
    return lines[1] if len(lines[1]) == 40 else None


def provenance():
    """``{"version", "commit", "made"}``: ``made`` is "vendored YYYY-MM-DD", "wheel", "checkout" or "unknown"."""
    import sys

    __version__ = sys.modules[__package__].__version__  # the package itself: imported before any of its modules
    if STAMP is not None:
        commit, date, how = STAMP
        return {"version": __version__, "commit": commit, "made": f"{how} {date}".strip()}
    commit = _checkout_commit(os.path.dirname(os.path.abspath(__file__)))
    return {"version": __version__, "commit": commit or "unknown", "made": "checkout" if commit else "unknown"}


def describe():
    """One phrase: ``0.3.0 (commit 1a2b3c4d5e6f)``, ``0.3.0 (commit 1a2b3c4d5e6f, vendored 2026-12-05)``."""
    p = provenance()
    parts = ["commit unknown" if p["commit"] == "unknown" else f"commit {p['commit'][:12]}"]
    if p["made"] not in ("checkout", "unknown"):
        parts.append(p["made"])
    return f"{p['version']} ({', '.join(parts)})"


def stamp_text(commit, date, how):
    """This file's text with ``STAMP`` set (what ``vendor`` and the wheel build write)."""
    import re

    with open(os.path.abspath(__file__)) as fh:
        text = fh.read()
    stamped, n = re.subn(r"^STAMP = .*$", f"STAMP = ({commit!r}, {date!r}, {how!r})", text, count=1, flags=re.M)
    if n != 1:
        raise RuntimeError("tfcompat/_provenance.py has no STAMP line to rewrite")
    return stamped
