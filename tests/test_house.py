"""House rules on pp_tp's source, checked by reading it (ast only; nothing is imported): no import circle,
no long file or function, private torch names only in pp_tp/_torch.py, and generic folders free of models.
See docs/design.md."""

from __future__ import annotations

import ast
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

# Attributes of torch objects that are private; pp_tp reaches them only through pp_tp/_torch.py.
TORCH_PRIVATE_ATTRS = {
    "_modules",
    "_parameters",
    "_buffers",
    "_local_tensor",
    "_non_persistent_buffers_set",
    "_compiled_call_impl",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
    "_version",
    "_fsdp_param_groups",
    "_state_ctx",
    "_root_post_backward_final_callback",
    "_maybe_compute_loss",
    "_wait_batch_p2p",
    "_load_csv",
    "_resolve_process_group",
}
DOOR = "_torch.py"


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


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(mod: str) -> tuple[set[str], list[tuple[str, str]]]:
    """(modules imported at import time, [(function, module) for imports inside functions])."""
    top: set[str] = set()
    inner: list[tuple[str, str]] = []

    def walk(body: list[ast.stmt], func: str | None) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in _targets(mod, node):
                    (top.add(t) if func is None else inner.append((func, t)))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                walk(node.body, node.name)
            elif isinstance(node, ast.If) and func is None and _is_type_checking(node):
                continue  # annotations only, never executed
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


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
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
    """Module-level imports only, an import of pp_tp.a.b counting as one of package pp_tp.a too."""
    assert _cycles(GRAPH) == []


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


def _private_torch_uses(tree: ast.Module) -> list[str]:
    """Private torch names a module reaches: imports from or of a private torch path, `torch._x` attributes,
    and the known private attributes of torch objects (`._modules`, `._local_tensor`, ...)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("torch") and _private_path(a.name)]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch") and not node.level:
            names = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            if _private_path(node.module) or names:
                found.append(f"from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Attribute):
            text = ast.unparse(node)
            if node.attr in TORCH_PRIVATE_ATTRS or (text.startswith("torch.") and _private_path(text)):
                found.append(text)
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("getattr", "setattr", "hasattr"):
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and name.value in TORCH_PRIVATE_ATTRS:
                found.append(ast.unparse(node))
    return found


def _private_path(dotted: str) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in dotted.split(".")[1:])


def test_private_torch_names_only_behind_the_door() -> None:
    uses = {_rel(m): u for m, tree in TREES.items() if SOURCES[m].name != DOOR and (u := _private_torch_uses(tree))}
    assert uses == {}, "reach private torch names through pp_tp/_torch.py (one line on why, and the public way)"


def test_generic_folders_import_no_model() -> None:
    generic = ("pp_tp.stages", "pp_tp.parallel", "pp_tp.schedules")
    bad = {}
    for mod in SOURCES:
        if mod.startswith(generic):
            targets = GRAPH[mod] | {t for _, t in _imports(mod)[1]}
            if models := sorted(t for t in targets if t == "pp_tp.models" or t.startswith("pp_tp.models.")):
                bad[_rel(mod)] = models
    assert bad == {}
