"""``tfcompat vendor DEST``: copy the package into a project (relative imports throughout, so the copy is
importable under any parent package), stamp it, and make its parent folders packages."""

import datetime
import os
import shutil
import sys

from .. import __version__, _provenance
from .common import _PROG

_MARKER = "VENDORED"


def vendor(args):
    source = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package, above this folder
    dest = os.path.abspath(args.dest)
    refused, earlier = _refusal(args, source, dest)
    if refused:
        print(f"{_PROG} vendor: {refused}", file=sys.stderr)
        return 2
    skip = os.path.join(source, "_tools") if args.no_tools else None
    written, refused = _copy(source, dest, skip)
    if refused:
        print(f"{_PROG} vendor: {refused}", file=sys.stderr)
        return 2
    stale = _drop_stale(dest, written) if earlier else []
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    commit = _provenance.provenance()["commit"]
    # the stamp a wheel of the vendoring project carries (VENDORED is not a module, so a wheel leaves it out)
    with open(os.path.join(dest, "_provenance.py"), "w") as fh:
        fh.write(_provenance.stamp_text(commit, stamp, "vendored"))
    with open(os.path.join(dest, _MARKER), "w") as fh:  # never a path: this file lands in other repositories
        fh.write(f"tfcompat {__version__}\nvendored {stamp}\ncommit {commit}\n"
                 f"{'without its tools (--no-tools)' if skip else 'with its tools'}\n"
                 f"Import it relatively (from ._vendor import tfcompat). Do not edit it: to update it, run "
                 f"`tfcompat vendor <this folder>` from a newer tfcompat checkout (it replaces this copy).\n")
    made = _parent_packages(dest)
    print(f"copied tfcompat {__version__} ({len(written)} files{', no tools' if skip else ''}) into {dest}; "
          f"wrote {os.path.join(dest, _MARKER)}")
    for path in stale:
        print(f"removed {path} (the earlier copy's, not in this one)")
    for path in made:
        print(f"made {path} (a package, so setuptools' find_packages puts the copy in your wheel)")
    return 0


def _refusal(args, source, dest):
    """(why DEST cannot be written, or None; whether DEST holds an earlier copy)."""
    if os.path.islink(args.dest.rstrip(os.sep)) or os.path.islink(dest):
        return f"{args.dest} is a symlink; refusing to write through it", False
    if os.path.commonpath([source, dest]) in (source, dest):
        return f"{dest} overlaps the package being copied ({source})", False
    if not os.path.exists(dest):
        return None, False
    if not os.path.isdir(dest):
        return f"{dest} exists and is not a folder", False
    earlier = os.path.isfile(os.path.join(dest, _MARKER))
    if os.listdir(dest) and not earlier and not args.force:
        return (f"{dest} exists and is not an earlier tfcompat copy (no {_MARKER} file); pass --force to copy "
                f"into it anyway"), False
    return None, earlier


def _copy(source, dest, skip):
    """Copy the package's files (not ``skip``, caches, links) into DEST: (paths written, why it stopped or None)."""
    written = []
    for root, dirs, files in os.walk(source, followlinks=False):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not os.path.islink(os.path.join(root, d))
                         and os.path.join(root, d) != skip)
        target_dir = os.path.normpath(os.path.join(dest, os.path.relpath(root, source)))
        for name in sorted(files):
            src = os.path.join(root, name)
            if os.path.islink(src) or name.endswith((".pyc", ".pyo")):
                continue
            target = os.path.join(target_dir, name)
            if not _inside(dest, target):
                return written, f"{target} would escape {dest}; nothing more written"
            os.makedirs(target_dir, exist_ok=True)
            if os.path.islink(target):
                return written, f"{target} is a symlink; refusing to write through it"
            shutil.copyfile(src, target)
            written.append(os.path.relpath(target, dest))
    return written, None


def _drop_stale(dest, written):
    """An earlier copy's modules that this one does not have (renamed or moved since, or the tools left out):
    removed, so the copy imports only what this release ships. Links and foreign file kinds are left alone."""
    keep = set(written) | {_MARKER}
    removed = []
    for root, dirs, files in os.walk(dest, topdown=False, followlinks=False):
        for name in files:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, dest)
            if rel not in keep and not os.path.islink(path) and name.endswith((".py", ".pyc", ".typed")):
                os.remove(path)
                removed.append(rel)
        for name in dirs:
            path = os.path.join(root, name)
            if not os.path.islink(path) and not os.listdir(path):
                os.rmdir(path)
    return sorted(r for r in removed if not r.endswith(".pyc"))


_ROOT_MARKERS = ("pyproject.toml", "setup.py", "setup.cfg", ".git")


def _parent_packages(dest):
    """Empty ``__init__.py`` in every folder between the project root (the nearest folder above DEST with a
    pyproject.toml, setup.py, setup.cfg or .git; else DEST's parent) and DEST that lacks one: without them
    ``find_packages`` (verl's setup.py, most setuptools projects) leaves the vendored copy out of a wheel."""
    folders = []
    here = os.path.dirname(dest)
    while True:
        if any(os.path.exists(os.path.join(here, m)) for m in _ROOT_MARKERS):
            break
        folders.append(here)
        up = os.path.dirname(here)
        if up == here:  # no project root above: only DEST's parent
            folders = folders[:1]
            break
        here = up
    made = []
    for folder in reversed(folders):
        init = os.path.join(folder, "__init__.py")
        if not os.path.exists(init):
            with open(init, "w") as fh:
                fh.write("# made by `tfcompat vendor`: the vendored copy below is a package of this project\n")
            made.append(init)
    return made


def _inside(root, path):
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    return os.path.commonpath([real_root, real]) == real_root
