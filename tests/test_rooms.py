"""The package's rooms by lifetime, read from its files with ``ast`` (nothing imported): each room imports only
itself and the rooms below it, counting module-level imports and imports inside functions alike, in the order

    base (errors, version, _provenance) < _kernels < _probe < _step < the public face < _tools

and the longest chain of imports (the floors) is what the README and docs/design.md state, at most 7 for the package
without the tools, counted both ways. No cycle either way."""

import functools
import pathlib
import re

import pytest

import tfcompat

from _helpers import ONCE

pytestmark = ONCE  # the package's files: no release moves them

ROOT = pathlib.Path(tfcompat.__file__).parent
ORDER = ("base", "_kernels", "_probe", "_step", "public", "_tools")
BASE = {"errors", "version", "_provenance"}
DOCS = tuple(pathlib.Path(__file__).resolve().parents[1] / name for name in ("README.md", "docs/design.md"))


def _module_graph(function_level=True):
    """Each module's relative imports, at module level only or inside functions too: the reader ``tfcompat vendor
    --only`` computes a layer's closure with (one reader; what it reads is asserted below against the rooms)."""
    from tfcompat._tools.vendor import module_graph  # private: the one module-graph reader

    return module_graph(str(ROOT), function_level)


def room(module):
    head = module.split(".")[0]
    if module in BASE:
        return "base"
    if head in ("_kernels", "_probe", "_step", "_tools") or module == "__main__":
        return "_tools" if module == "__main__" else head
    return "public"


def floors(graph, tools):
    """The longest chain of imports (in modules, the importing one and ``errors`` included) above each module."""
    @functools.lru_cache(maxsize=None)
    def floor(m):
        return 1 + max((floor(d) for d in graph[m] if tools or room(d) != "_tools"), default=0)

    return {m: floor(m) for m in graph if tools or room(m) != "_tools"}


@pytest.mark.parametrize("function_level", [False, True], ids=["module-level", "function-level"])
def test_rooms_import_only_downward(function_level):
    graph = _module_graph(function_level)
    up = sorted(f"{m or 'tfcompat'} ({room(m)}) -> {d or 'tfcompat'} ({room(d)})" for m, deps in graph.items()
                for d in deps if ORDER.index(room(d)) > ORDER.index(room(m)))
    assert not up, up


def test_the_package_imports_only_downward():
    """No import cycle between the package's modules, counting imports inside functions too (a cycle there
    still ties two rooms together): the module graph read with ast is acyclic."""
    graph = _module_graph()
    state, cycle = {}, []

    def visit(node, stack):
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycle.extend(stack[stack.index(dep):] + [dep] if dep in stack else [node, dep])
                return True
            if dep not in state and visit(dep, stack + [dep]):
                return True
        state[node] = "done"
        return False

    for module in sorted(graph):
        if module not in state and visit(module, [module]):
            break
    assert not cycle, f"import cycle: {' -> '.join(m or 'tfcompat' for m in cycle)}"


def test_room_rules():
    """Nothing outside the tools imports them (``python -m tfcompat`` names them only to say a copy lacks them), so
    ``tfcompat vendor --no-tools`` gives a copy that works; nothing below the public face imports ``testing``; the
    kernels import only the base and each other (pure tensor code)."""
    graph = _module_graph()
    bad = [f"{m} -> {d}" for m, deps in graph.items() for d in deps
           if (room(d) == "_tools" and room(m) != "_tools")
           or (d == "testing" and ORDER.index(room(m)) < ORDER.index("public"))
           or (room(m) == "_kernels" and room(d) not in ("base", "_kernels"))]
    assert not bad, bad


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_floors_are_what_the_docs_state(doc):
    """The README and docs/design.md state the floors; the package's stay at most 7 counted either way."""
    text = " ".join(doc.read_text().split())
    stated = re.search(r"[Ii]mport floors[^:]*: (\d+) counting module-level imports and (\d+) with the ones inside "
                       r"functions, for the package; (\d+) and (\d+) with the tools", text)
    assert stated, f"{doc.name} no longer states the floors in its sentence"
    module, function, module_tools, function_tools = map(int, stated.groups())
    got = (max(floors(_module_graph(False), False).values()), max(floors(_module_graph(True), False).values()),
           max(floors(_module_graph(False), True).values()), max(floors(_module_graph(True), True).values()))
    assert got == (module, function, module_tools, function_tools), got
    assert module <= 7 and function <= 7


def test_no_code_branches_on_a_kernels_name():
    """Each row of the kernel table carries its ``available()``, its call and its proof, so no code compares a
    packed-attention kernel's name to pick what to do (``if kind == "flash_attn"``): read with ``ast`` over the
    package, save the tools (which print per kernel) and the public ``flash_attn_available``, whose question is
    the name itself."""
    import ast

    names = {"flash_attn", "flash_attn_3", "torch_varlen", "sdpa"}
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("_tools/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                     for op in node.ops):
                consts = {c.value for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)}
                consts |= {e.value for c in node.comparators if isinstance(c, (ast.Tuple, ast.Set, ast.List))
                           for e in c.elts if isinstance(e, ast.Constant)}
                if "eager" in consts:  # transformers' attn_implementation names, not the table's kernels
                    continue
                if consts & names and not (rel == "varlen.py" and "flash_attn" in consts
                                           and isinstance(node.left, ast.Call)):
                    found.append(f"{rel}:{node.lineno}")
    assert not found, f"code branching on a kernel's name (give the row the behaviour instead): {found}"


def test_sizes_stay_within_the_house_rules():
    """No module of the package over 350 lines, no function over 60 (docs/design.md): a module past them holds two
    features, a function two steps."""
    import ast

    long_modules, long_functions = [], []
    for path in sorted(p for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts):
        text = path.read_text()
        name = str(path.relative_to(ROOT))
        if len(text.splitlines()) > 350:
            long_modules.append(f"{name}: {len(text.splitlines())}")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long_functions.append(f"{name}:{node.name}: {node.end_lineno - node.lineno + 1}")
    assert not long_modules and not long_functions, (long_modules, long_functions)
