"""House rules on pp_tp's source, checked by reading it (ast only; nothing is imported): no import circle between
modules or packages, the builder core apart from what is built around it, no long file or function, private names
of other code (torch's above all) only in pp_tp/base/_torch.py,
and generic folders free of models. See docs/design.md."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "pp_tp"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60

# Every pp_tp import made inside a function, as "path:function -> module", with its reason. Keep the list short:
# a new entry needs a reason, and none may hide a circle (test_function_level_imports_close_no_circle).
FUNCTION_LEVEL_IMPORTS: dict[str, str] = {}

# Known functions over MAX_FUNCTION_LINES, as "path:function", in files whose owners are splitting them.
# TO BE REMOVED, each as its function is split; the test fails on any other long function.
LONG_FUNCTIONS_TO_REMOVE: set[str] = set()

DOOR = "_torch.py"
DESIGN = PKG.parent / "docs" / "design.md"
MAY_IMPORT_MARK = "<!-- may-import: tests/test_house.py reads this table -->"


def _sources() -> dict[str, Path]:
    """Module name -> file, for every module of pp_tp."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


SOURCES = _sources()
TREES = {mod: ast.parse(path.read_text(), str(path)) for mod, path in SOURCES.items()}


def _rel(mod: str) -> str:
    return str(SOURCES[mod].relative_to(PKG.parent))


def _targets(mod: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The pp_tp modules an import statement in `mod` loads (`from pp_tp.x import y`: pp_tp.x.y if a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in SOURCES]
    base = node.module or ""
    if node.level:  # relative: resolve against the importing package
        pkg = mod.split(".") if SOURCES[mod].name == "__init__.py" else mod.split(".")[:-1]
        base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
    if base.split(".")[0] != "pp_tp":
        return []
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in SOURCES else base for a in node.names]


def _imports(mod: str) -> tuple[set[str], list[tuple[str, str]]]:
    """(modules imported at module level, [(function, module) for imports inside functions]). Imports under
    `if TYPE_CHECKING:` count as module level: they are a dependency, and a circle through them is one too."""
    top: set[str] = set()
    inner: list[tuple[str, str]] = []

    def walk(body: list[ast.stmt], func: str | None) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in _targets(mod, node):
                    (top.add(t) if func is None else inner.append((func, t)))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                walk(node.body, node.name)
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    walk([s for s in getattr(node, field, []) if isinstance(s, ast.AST)], func)

    walk(TREES[mod].body, None)
    top |= {pkg for t in top for pkg in _packages(t) - _packages(mod) - {mod}}
    top.discard(mod)
    return top, inner


def _packages(mod: str) -> set[str]:
    """The packages whose __init__ an import of `mod` runs first (pp_tp's own aside: every module runs it)."""
    parts = mod.split(".")
    return {".".join(parts[:i]) for i in range(2, len(parts))}


GRAPH = {mod: _imports(mod)[0] for mod in SOURCES}
# Every pp_tp module a module imports, wherever the import sits (module level, type-only, inside a function).
ALL_IMPORTS = {mod: GRAPH[mod] | {t for _, t in _imports(mod)[1]} for mod in SOURCES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle() -> None:
    """Module-level imports (type-only ones included), an import of pp_tp.a.b counting as one of package pp_tp.a."""
    assert _cycles(GRAPH) == []


def _package_of(mod: str) -> str:
    """The node of `mod` in the package graph: pp_tp.x for pp_tp.x and every pp_tp.x.y...; pp_tp.m for a top module."""
    return ".".join(mod.split(".")[:2])


def _package_graph() -> dict[str, dict[str, list[str]]]:
    """Package -> {package it imports: ["importer -> imported", ...]}, over every import; the root pp_tp left out."""
    graph: dict[str, dict[str, list[str]]] = {_package_of(m): {} for m in SOURCES if m != "pp_tp"}
    for mod, targets in ALL_IMPORTS.items():
        for t in targets:
            src, dst = _package_of(mod), _package_of(t)
            if "pp_tp" not in (mod, t) and src != dst:
                graph[src].setdefault(dst, []).append(f"{mod} -> {t}")
    return graph


def test_no_package_cycle() -> None:
    """Between packages (pp_tp.x stands for every pp_tp.x.y), type-only and function-level imports included."""
    graph = _package_graph()
    cycles = _cycles({pkg: set(edges) for pkg, edges in graph.items()})
    assert cycles == [], {f"{a} -> {b}": graph[a][b] for c in cycles for a in c for b in c if b in graph[a]}


def _may_import() -> dict[str, set[str]]:
    """docs/design.md's table "what each folder may import": unit -> the units it may import (one home for the rule)."""
    text = DESIGN.read_text()
    block = text[text.index(MAY_IMPORT_MARK) :].split("```")[1]
    rows = [line.split() for line in block.strip().splitlines()[1:]]
    return {row[0]: set(row[1:]) - {"-"} for row in rows}


def _unit(mod: str) -> str:
    """The folder (or root module) `mod` belongs to: pp_tp.parallel.fsdp -> parallel, pp_tp.errors -> errors."""
    return mod.split(".")[1] if "." in mod else "pp_tp"


def test_every_folder_imports_only_what_the_design_allows() -> None:
    allowed = _may_import()
    assert {_unit(m) for m in SOURCES} - set(allowed) == set(), "give the new folder a row in docs/design.md"
    bad = {
        _rel(m): out
        for m in SOURCES
        if (out := sorted(t for t in ALL_IMPORTS[m] if _unit(t) not in allowed[_unit(m)] | {_unit(m)}))
    }
    assert bad == {}, "import only what docs/design.md's table allows, or change the table with why"


def test_the_design_table_allows_no_circle() -> None:
    """The table itself is layered: following what may be imported never comes back (the root pp_tp aside)."""
    table = {u: deps - {"pp_tp"} for u, deps in _may_import().items() if u != "pp_tp"}
    assert _cycles(table) == []


def _function_level() -> dict[str, tuple[str, str]]:
    """ "path:function -> module" -> (importer, imported), for every pp_tp import inside a function."""
    return {f"{_rel(m)}:{func} -> {t}": (m, t) for m in SOURCES for func, t in _imports(m)[1]}


def test_function_level_imports_are_listed() -> None:
    found = set(_function_level())
    assert found - set(FUNCTION_LEVEL_IMPORTS) == set(), "move the import to module level, or list it with why"
    assert set(FUNCTION_LEVEL_IMPORTS) - found == set(), "a listed import is gone: drop it from the list"


def test_function_level_imports_close_no_circle() -> None:
    graph = {mod: set(targets) for mod, targets in GRAPH.items()}
    for importer, imported in _function_level().values():
        graph[importer].add(imported)
    assert _cycles(graph) == []


def test_no_long_file() -> None:
    long = {_rel(m): n for m, p in SOURCES.items() if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert long == {}


def test_no_long_function() -> None:
    long = {}
    for mod, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{_rel(mod)}:{node.name}"] = n
    assert set(long) - LONG_FUNCTIONS_TO_REMOVE == set(), long
    assert LONG_FUNCTIONS_TO_REMOVE <= set(long), "a listed long function was split: drop it from the list"


# --- private names ----------------------------------------------------------------------------------------------
# An ast cannot tell whose object `obj._name` reads, so the rule goes by name: an underscore attribute pp_tp does
# not define itself is another library's private name (torch's: `schedule._stages`, `storage._cdata`, ...).

# Private names of libraries other than torch that pp_tp relies on, each with why. torch's never go here: they go
# through pp_tp/base/_torch.py.
OTHER_PRIVATE_NAMES: dict[str, str] = {
    "_SubParsersAction": "argparse: the type of add_subparsers(), in annotations only; argparse names it nowhere else",
    "_attn_implementation": "transformers: the config's attention choice, read and set the way transformers does",
    "_init_weights": "transformers: a model's own per-module init rule, rerun to recompute buffers",
    "_can_record_outputs": "transformers: which module class a model records its router_logits from (MoE balancing)",
    "_param_init": "torchtitan: a module's per-parameter init rules",
    "_init_self_buffers": "torchtitan: a RoPE module's buffer init",
    "_get_dataloader": "transformers Trainer: its loader builder (columns, collator, sampler), at dp x the batch",
    "_get_train_sampler": "transformers Trainer: its training sampler, for _get_dataloader",
    "_get_eval_sampler": "transformers Trainer: its evaluation sampler, for _get_dataloader",
}
# Nodes with a scope of their own: names bound inside them are neither module globals nor class attributes.
NEW_SCOPES = (
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.Lambda,
    ast.ListComp,
    ast.SetComp,
    ast.DictComp,
    ast.GeneratorExp,
)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_path(dotted: str) -> bool:
    return any(_private(p) for p in dotted.split(".")[1:])


def _scope_nodes(nodes: Iterable[ast.AST]) -> Iterable[ast.AST]:
    """The nodes of a module or class body, those inside functions and comprehensions (their own scopes) left out."""
    for node in nodes:
        yield node
        if not isinstance(node, NEW_SCOPES):
            yield from _scope_nodes(ast.iter_child_nodes(node))


def _own_names(trees: Iterable[ast.Module]) -> set[str]:
    """Every underscore name pp_tp defines: functions, classes and methods anywhere, module globals and class
    attributes (dataclass fields included), and attributes it assigns on `self` or `cls`."""
    names: set[str] = set()
    for tree in trees:
        names |= {n.id for n in _scope_nodes(tree.body) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    names.add(node.attr)
    return {n for n in names if _private(n)}


def _private_uses(tree: ast.Module, own: set[str]) -> list[str]:
    """Other libraries' private names a module reaches: imports of or from a private torch path, private names
    imported from torch, `torch._x` / `torch.a._b`, and every underscore attribute not in `own` (`x._y`,
    `getattr(x, "_y")`, `x.__dict__["_y"]`)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.startswith("torch") and _private_path(a.name)]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch") and not node.level:
            if _private_path(node.module) or any(_private(a.name) for a in node.names):
                found.append(f"from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            text = ast.unparse(node)
            if node.attr not in own or (text.split(".")[0] == "torch" and _private_path(text)):
                found.append(text)
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("getattr", "setattr", "hasattr", "delattr"):
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value):
                found += [] if name.value in own else [ast.unparse(node)]
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("__dict__"):
            key = node.slice
            if isinstance(key, ast.Constant) and isinstance(key.value, str) and _private(key.value):
                found += [] if key.value in own else [ast.unparse(node)]
    return found


OWN = _own_names(TREES.values())


def test_private_names_only_behind_the_door() -> None:
    allowed = OWN | set(OTHER_PRIVATE_NAMES)
    uses = {_rel(m): u for m, t in TREES.items() if SOURCES[m].name != DOOR and (u := _private_uses(t, allowed))}
    assert uses == {}, "reach private torch names through pp_tp/base/_torch.py (one line on why, and the public way)"
    assert not set(OTHER_PRIVATE_NAMES) & OWN, "a listed name is pp_tp's own now: drop it from the list"
    used = " ".join(u for m, t in TREES.items() if SOURCES[m].name != DOOR for u in _private_uses(t, OWN))
    stale = {n for n in OTHER_PRIVATE_NAMES if not re.search(rf"\b{n}\b", used)}
    assert stale == set(), "a listed name is no longer used: drop it"


def test_private_name_check_catches_what_it_should() -> None:
    mine = (
        "class A:\n    _field: int = 0\n\n    def __init__(self):\n        self._mine, self.b = 1, [_x for _x in ()]\n"
    )
    own = _own_names([ast.parse(mine + "\n\ndef _f():\n    _local = 1\n")])
    assert own == {"_field", "_mine", "_f"}
    caught = {
        "x._cdata": ["x._cdata"],
        "func._overloadpacket": ["func._overloadpacket"],
        "getattr(func, '_overloadpacket', None)": ["getattr(func, '_overloadpacket', None)"],
        "schedule._stages[0]": ["schedule._stages"],
        "del schedule.__dict__['_maybe_compute_loss']": ["schedule.__dict__['_maybe_compute_loss']"],
        "from torch._subclasses import FakeTensorMode": ["from torch._subclasses import FakeTensorMode"],
        "from torch.utils import _pytree": ["from torch.utils import _pytree"],
        "import torch.distributed._functional_collectives": ["import torch.distributed._functional_collectives"],
        "import torch.distributed.pipelining._backward as b": ["import torch.distributed.pipelining._backward"],
        "torch._foreach_mul_(xs, 2)": ["torch._foreach_mul_"],
        "torch.distributed._mine": ["torch.distributed._mine"],  # torch's, though pp_tp has a `_mine` too
    }
    for source, expected in caught.items():
        assert _private_uses(ast.parse(source), own) == expected, source
    for source in ("self._mine", "a._field", "getattr(self, '_mine')", "x.__class__", "from torch.nn import Linear"):
        assert _private_uses(ast.parse(source), own) == [], source
