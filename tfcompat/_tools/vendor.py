"""``tfcompat vendor DEST``: copy the package into a project (relative imports throughout, so the copy is
importable under any parent package), stamp it, and make its parent folders packages. ``--only LAYER`` copies one
layer: the modules its public entries import, computed from the module graph (imports inside functions included),
so a partial copy imports and runs what it serves."""

import ast
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
    only = getattr(args, "only", None)
    skip = os.path.join(source, "_tools") if args.no_tools or only else None
    keep = layer_files(source, only) if only else None
    written, refused = _copy(source, dest, skip, keep)
    if refused:
        print(f"{_PROG} vendor: {refused}", file=sys.stderr)
        return 2
    stale = _drop_stale(dest, written) if earlier else []
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    commit = _provenance.provenance()["commit"]
    # the stamp a wheel of the vendoring project carries (VENDORED is not a module, so a wheel leaves it out)
    with open(os.path.join(dest, "_provenance.py"), "w") as fh:
        fh.write(_provenance.stamp_text(commit, stamp, "vendored" if not only else f"vendored --only {only}"))
    if only and "__init__.py" not in keep:
        with open(os.path.join(dest, "__init__.py"), "w") as fh:
            fh.write(_layer_init(only))
    with open(os.path.join(dest, _MARKER), "w") as fh:  # never a path: this file lands in other repositories
        fh.write(f"tfcompat {__version__}\nvendored {stamp}\ncommit {commit}\n"
                 f"{_what(only, skip)}\n"
                 f"Import it relatively (from ._vendor import tfcompat). Do not edit it: to update it, run "
                 f"`tfcompat vendor <this folder>` from a newer tfcompat checkout (it replaces this copy).\n")
    made = _parent_packages(dest)
    print(f"copied tfcompat {__version__} ({len(written)} files{', layer ' + only if only else ''}"
          f"{', no tools' if skip and not only else ''}) into {dest}; "
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


#: each layer's public entries (``--only``): its copy holds them and every module they import
LAYERS = {
    "rope": ("rope",),
    "config": ("config",),
    "varlen": ("varlen", "packing"),
    "patch": ("", "packing", "varlen", "ulysses", "embeds", "rope", "config", "testing"),
}


def _what(only, skip):
    if only:
        entries = ", ".join(m or "the package root" for m in LAYERS[only])
        return f"one layer (--only {only}): {entries} and what they import"
    return "without its tools (--no-tools)" if skip else "with its tools"


def module_graph(source, function_level=True):
    """Each module of the package at ``source`` (dotted, relative: "" the package, "_step.patch") and the modules it
    imports relatively, read with ast: anywhere in its file, inside functions too, or (``function_level=False``)
    at module level only (the body with its ``if`` and ``try`` blocks). ``tests/test_rooms.py`` reads it too."""
    graph = {}
    for folder, dirs, files in os.walk(source):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for file in files:
            if not file.endswith(".py"):
                continue
            path = os.path.join(folder, file)
            parts = os.path.relpath(path, source)[:-3].split(os.sep)
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            package = name if file == "__init__.py" else name.rpartition(".")[0]
            deps = set()
            with open(path) as fh:
                tree = ast.parse(fh.read())
            nodes = ast.walk(tree) if function_level else [
                n for top in tree.body if not isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                for n in ast.walk(top)]
            for node in nodes:
                if isinstance(node, ast.ImportFrom) and node.level:
                    base = package.split(".") if package else []
                    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                    target = ".".join(base + ([node.module] if node.module else []))
                    for alias in node.names:
                        sub = f"{target}.{alias.name}".lstrip(".")
                        deps.add(sub if os.path.exists(os.path.join(source, *sub.split(".")) + ".py") else target)
            graph[name] = deps - {name}
    return {k: {d for d in v if d in graph} for k, v in graph.items()}


def layer_files(source, layer):
    """The files (relative to the package) of a layer's copy: its entries' import closure, the ``__init__.py`` of
    every subpackage it reaches, ``py.typed`` and ``_provenance.py``. The package root's ``__init__.py`` only where
    the layer serves it (patch); the others get one written for them."""
    graph = module_graph(source)
    seen, todo = set(), list(LAYERS[layer])
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph[m])
    files = {"py.typed", "_provenance.py"}
    for m in seen:
        parts = m.split(".") if m else []
        if os.path.isdir(os.path.join(source, *parts)) and parts:
            files.add(os.path.join(*parts, "__init__.py"))
        elif parts:
            files.add(os.path.join(*parts) + ".py")
        else:
            files.add("__init__.py")
        for i in range(1, len(parts)):  # the subpackages above it
            files.add(os.path.join(*parts[:i], "__init__.py"))
    return files


def _layer_init(layer):
    """The package root of a one-layer copy: the version, and a clear refusal for what the layer does not hold."""
    entries = ", ".join(m for m in LAYERS[layer] if m)
    why = (f"this copy was vendored with `tfcompat vendor --only {layer}`, which holds the module(s) {entries} and "
           f"what they import; vendor the whole package (or --only patch) for the rest")
    return (f'"""tfcompat {__version__}, one layer (`tfcompat vendor --only {layer}`): the module(s) {entries} and\n'
            f'what they import. For patch() and the rest, vendor the whole package (or --only patch)."""\n\n'
            f'__version__ = "{__version__}"\n\n\n'
            f"def __getattr__(name):\n"
            f"    raise AttributeError(f\"module {{__name__!r}} has no attribute {{name!r}}: \"\n"
            f"                         {why!r})\n")


def _copy(source, dest, skip, keep=None):
    """Copy the package's files (not ``skip``, caches, links; with ``keep``, only those relative paths) into DEST:
    (paths written, why it stopped or None)."""
    written = []
    for root, dirs, files in os.walk(source, followlinks=False):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not os.path.islink(os.path.join(root, d))
                         and os.path.join(root, d) != skip)
        target_dir = os.path.normpath(os.path.join(dest, os.path.relpath(root, source)))
        for name in sorted(files):
            src = os.path.join(root, name)
            if os.path.islink(src) or name.endswith((".pyc", ".pyo")):
                continue
            if keep is not None and os.path.relpath(src, source) not in keep:
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
