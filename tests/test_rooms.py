"""The package's rooms: a folder per feature (``_rope``, ``_attention``, ``_parallel``, ``_probe``, ``_step``,
``_tools``), each module on the floor of its lifetime, read from its files with ``ast`` (nothing imported). Each
module imports only its own floor and the floors below it, counting module-level imports and imports inside
functions alike, in the order

    base (errors, version, _provenance) < kernel < probe < step < the public face < tools

:data:`FLOORS` places every module (a new module fails :func:`test_every_module_has_a_floor` until it is placed),
and the longest chain of imports (the floors) is what the README and docs/design.md state, at most 7 for the
package without the tools, counted both ways. No cycle either way."""

import functools
import pathlib
import re

import pytest

import tfcompat

from _helpers import ONCE

pytestmark = ONCE  # the package's files: no release moves them

ROOT = pathlib.Path(tfcompat.__file__).parent
ORDER = ("base", "kernel", "probe", "step", "public", "tools")
#: every module's floor, by feature: a folder's name with ``.*`` places the whole folder (its ``__init__`` too)
FLOORS = {
    "base": ("errors", "version", "_provenance"),
    "kernel": ("_kernels.*",
               "_rope", "_rope.native", "_rope.fused", "_rope.fused_proof", "_rope.implementation",
               "_attention", "_attention.cu", "_attention.gpu_calls", "_attention.kernel_choice", "_attention.kernels",
               "_parallel", "_parallel.collectives", "_parallel.context"),
    "probe": ("_probe.*", "_rope.settings"),
    "step": ("_step.*",
             "_attention.starts", "_attention.boundaries", "_attention.traced", "_attention.attend",
             "_attention.bundled",
             "_parallel.shards"),
    "public": ("", "config", "embeds", "packing", "rope", "testing", "trainer", "ulysses", "varlen"),
    "tools": ("_tools.*", "__main__"),
}
DOCS = tuple(pathlib.Path(__file__).resolve().parents[1] / name for name in ("README.md", "docs/design.md"))


def _module_graph(function_level=True):
    """Each module's relative imports, at module level only or inside functions too: the reader ``tfcompat vendor
    --only`` computes a layer's closure with (one reader; what it reads is asserted below against the rooms)."""
    from tfcompat._tools.vendor import module_graph  # private: the one module-graph reader

    return module_graph(str(ROOT), function_level)


def room(module):
    """The floor :data:`FLOORS` gives a module (None: not placed)."""
    folder = module.split(".")[0] + ".*"
    for floor, names in FLOORS.items():
        if module in names or folder in names:
            return floor
    return None


def test_every_module_has_a_floor():
    """Every module of the package is placed in :data:`FLOORS`, and every name there is a module (no stale row)."""
    graph = _module_graph()
    unplaced = sorted(m for m in graph if room(m) is None)
    stale = sorted(n for names in FLOORS.values() for n in names
                   if not n.endswith(".*") and n not in graph
                   or n.endswith(".*") and not any(m.split(".")[0] == n[:-2] for m in graph))
    assert not unplaced and not stale, (unplaced, stale)


def test_a_feature_lives_in_one_folder():
    """The kernels, probes and step code of RoPE, packed attention and sequence parallelism live in their feature's
    folder, and no module name is used twice (``rope.py`` beside ``_kernels/rope.py`` made every change a tour)."""
    graph = _module_graph()
    leaves = {}
    for m in graph:
        if m and "." in m:
            leaves.setdefault(m.rpartition(".")[2], []).append(m)
    public = {m for m in graph if m and "." not in m}
    twice = sorted((leaf, where) for leaf, where in leaves.items() if len(where) > 1 or leaf in public)
    assert not twice, twice
    for feature in ("_rope", "_attention", "_parallel"):  # its kernels and what decides or runs them, together
        spans = {room(m) for m in graph if m.split(".")[0] == feature and "." in m}
        assert "kernel" in spans and len(spans) >= 2, (feature, spans)
    # the lifetime folders hold no feature's module: the shared kernel table, the probes, the installed forwards
    # (``_step.rope_index`` is the embedding path's: the mRoPE positions ``embeds.rope_index`` serves)
    strays = sorted(m for m in graph if m.split(".")[0] in ("_kernels", "_probe", "_step")
                    and re.match(r"(rope|rotation|varlen|attention|attend|cu|collectives|context|shards|starts|"
                                 r"boundaries|traced|bundled)($|_)", m.rpartition(".")[2]) and m != "_step.rope_index")
    assert not strays, strays


#: imports kept only so that an older release's pickles find a name where it lived, left out of the floors (the
#: rules above and the vendor closure still count them): 0.3.0 pickled a patched attention module's forward as
#: ``_step.forwards.attention_forward`` (tests/test_training.py loads such a pickle)
ALIASES = {("_step.forwards", "_attention.attend")}


def floors(graph, tools):
    """The longest chain of imports (in modules, the importing one and ``errors`` included) above each module, the
    :data:`ALIASES` aside."""
    @functools.lru_cache(maxsize=None)
    def floor(m):
        return 1 + max((floor(d) for d in graph[m] if (tools or room(d) != "tools") and (m, d) not in ALIASES),
                       default=0)

    return {m: floor(m) for m in graph if tools or room(m) != "tools"}


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
           if (room(d) == "tools" and room(m) != "tools")
           or (d == "testing" and ORDER.index(room(m)) < ORDER.index("public"))
           or (room(m) == "kernel" and room(d) not in ("base", "kernel"))]
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
    assert all(d in _module_graph(False)[m] for m, d in ALIASES), "an alias no module imports any more: drop it"


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
