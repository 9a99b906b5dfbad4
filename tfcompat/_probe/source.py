"""Reading transformers' modeling modules as the probes see them.

The resolvers read transformers' modeling files as text (parsed with ``ast``) instead of importing
them: ``report`` then imports neither torch nor transformers, and a decision cannot depend on what
another library patched into a module at run time. The upstream object a Resolution names is imported
on first use (``Resolution.target``, through :func:`_load`). A stripped install (bytecode only) is
imported and inspected (:class:`_Imported`).
"""

import ast
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import os
import re


@dataclasses.dataclass(frozen=True)
class _Def:
    """A function or method as the probes see it."""

    where: str  # "Qwen2Attention.forward"
    params: tuple  # parameter names, without self
    body: str  # its source ("" where the install ships none)


@functools.lru_cache(maxsize=None)
def _root():
    spec = importlib.util.find_spec("transformers")  # a top-level name: found without importing it
    return os.path.dirname(spec.origin) if spec is not None and spec.origin else None


def _path(dotted):
    """Where transformers' module ``dotted`` lies, without the extension (None outside transformers)."""
    root = _root()
    if root is None or not dotted.startswith("transformers."):
        return None
    return os.path.join(root, *dotted.split(".")[1:])


def _read(dotted):
    """The text of transformers' module ``dotted``, or None where there is no .py file to read."""
    base = _path(dotted)
    if base is None:
        return None
    try:
        with open(f"{base}.py", encoding="utf-8") as fh:
            return fh.read()
    except OSError:
        return None


def _exists(dotted):
    """Whether the installed transformers ships module ``dotted`` (as source or bytecode), without importing."""
    base = _path(dotted)
    return base is not None and (os.path.exists(f"{base}.py") or os.path.exists(f"{base}.pyc"))


def _absolute(package, node):
    if not node.level:
        return node.module or ""
    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(parts + ([node.module] if node.module else []))


def _params(node):
    """Parameter names in signature order, as ``inspect.signature`` lists them, without self/cls."""
    a = node.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *([a.vararg] if a.vararg else []), *a.kwonlyargs,
                             *([a.kwarg] if a.kwarg else []))]
    return tuple(n for n in names if n not in ("self", "cls"))


_TOP = re.compile(r"^(?![\s#)\]}]|else\b|elif\b|except\b|finally\b)", re.M)  # where a top-level statement starts
_NAMED = re.compile(r"(?:async\s+)?(?:def|class)\s+(\w+)|(\w+)\s*[:=]")


class _Text:
    """One modeling module read from its file. Only the top-level statements a probe asks about are
    parsed (``ast`` over a whole 200 kB modeling file costs ~50 ms; a report reads ~30 of them)."""

    def __init__(self, name: str, text: str) -> None:
        self.name = name
        self._text = text
        self._package = name.rsplit(".", 1)[0]
        self._blocks: dict = {}  # name -> (start, end) of its top-level statement
        self._imports: dict = {}  # name -> (absolute module, name there)
        self._parsed: dict = {}
        starts = [m.start() for m in _TOP.finditer(text)] + [len(text)]
        i = 0
        while i < len(starts) - 1:
            begin = i
            while text.startswith("@", starts[i]) and i < len(starts) - 2:  # decorators join their def
                i += 1
            start, end = starts[begin], starts[i + 1]
            head = text[starts[i]: text.find("\n", starts[i])]
            named = _NAMED.match(head)
            if head.startswith(("from ", "import ", "if ", "try:")):
                self._walk(self._parse(start, end)[0].body)
            elif named:
                self._blocks.setdefault(named.group(1) or named.group(2), (start, end))
            i += 1

    def _parse(self, start, end):
        """``(tree, source)`` of the top-level statement at ``start``."""
        if (start, end) not in self._parsed:
            chunk = self._text[start:end]
            try:
                tree = ast.parse(chunk)
            except SyntaxError:  # a string with unindented lines cut the statement short
                chunk = self._statement_at(start)
                tree = ast.parse(chunk)
            self._parsed[start, end] = (tree, chunk)
        return self._parsed[start, end]

    def _statement_at(self, start):
        """The whole top-level statement around offset ``start``, found by parsing the entire file."""
        lines = self._text.splitlines(keepends=True)
        line = self._text.count("\n", 0, start) + 1
        for node in ast.parse(self._text).body:
            first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            if first <= line <= node.end_lineno:
                return "".join(lines[first - 1: node.end_lineno])
        raise SyntaxError(f"no statement at line {line} of {self.name}")

    def _walk(self, body):
        for node in body:
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    self._imports[alias.asname or alias.name] = (_absolute(self._package, node), alias.name)
            elif isinstance(node, (ast.If, ast.Try)):
                self._walk(node.body)
                self._walk(node.orelse)

    def has(self, name):
        return name in self._blocks or name in self._imports

    def _node(self, name, kinds):
        """The parsed top-level def/class ``name`` and its source lines, or None."""
        if name not in self._blocks:
            return None
        tree, source = self._parse(*self._blocks[name])
        node = tree.body[0] if tree.body else None
        return (node, source.splitlines(keepends=True)) if isinstance(node, kinds) else None

    @staticmethod
    def _source(node, lines):
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        return "".join(lines[first - 1: node.end_lineno])

    def _elsewhere(self, name):
        where = self._imports.get(name)
        return (_module(where[0]), where[1]) if where and _exists(where[0]) else (None, name)

    def function(self, name):
        found = self._node(name, (ast.FunctionDef, ast.AsyncFunctionDef))
        if found is not None:
            return _Def(name, _params(found[0]), self._source(*found))
        other, real = self._elsewhere(name)
        return other.function(real) if other is not None else None

    def method(self, cls, name):
        """``cls.name`` as Python finds it: in the class, else along its bases (here or where imported)."""
        found = self._node(cls, ast.ClassDef)
        if found is None:
            other, real = self._elsewhere(cls)
            return other.method(real, name) if other is not None else None
        node, lines = found
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == name:
                return _Def(f"{cls}.{name}", _params(item), self._source(item, lines))
        for base in node.bases:
            inherited = self.method(base.id, name) if isinstance(base, ast.Name) else None
            if inherited is not None:
                return inherited
        return None


class _Imported:
    """A modeling module without .py sources (a stripped or frozen install): imported and inspected;
    bodies are empty, so source probes fall back to the family's declared facts."""

    def __init__(self, name):
        self.name = name
        self._module = importlib.import_module(name)

    def has(self, name):
        return hasattr(self._module, name)

    @staticmethod
    def definition(where, fn):
        """A live function as the probes see it (its source, where the install ships it)."""
        fn = inspect.unwrap(fn)
        try:
            params = tuple(p for p in inspect.signature(fn).parameters if p not in ("self", "cls"))
        except (TypeError, ValueError):
            params = ()
        try:
            body = inspect.getsource(fn)
        except (OSError, TypeError):
            body = ""
        return _Def(where, params, body)

    def function(self, name):
        fn = getattr(self._module, name, None)
        return self.definition(name, fn) if callable(fn) else None

    def method(self, cls, name):
        fn = getattr(getattr(self._module, cls, None), name, None)
        return self.definition(f"{cls}.{name}", fn) if fn is not None else None


@functools.lru_cache(maxsize=None)
def _module(name):
    text = _read(name)
    if text is not None:
        return _Text(name, text)
    return _Imported(name)  # raises ImportError where the release has no such module


def _load(locator):
    """Import the upstream object a Resolution names: ``(module, "attr.attr")``."""
    obj = importlib.import_module(locator[0])
    for part in filter(None, locator[1].split(".")):
        obj = getattr(obj, part)
    return obj


