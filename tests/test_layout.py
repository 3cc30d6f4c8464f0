"""The package's architecture as its imports draw it: no import circles between kt_serve's modules, no module
importing another's private name, SGLang imported by the plugin package only, and no module past ~600 lines."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kt_serve"
MAX_LINES = 600


def modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = (path, ast.parse(path.read_text(), str(path)))
    return out


def imports(name: str, path: Path, tree: ast.Module):
    """(module imported, names taken from it) for every import statement, top level or inside a function."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            yield base, tuple(alias.name for alias in node.names)


def graph(mods) -> dict[str, set[str]]:
    """kt_serve module -> the kt_serve modules it imports (a name that is itself a module counts as that module)."""
    edges = {}
    for name, (path, tree) in mods.items():
        targets = set()
        for base, names in imports(name, path, tree):
            for target in [f"{base}.{n}" for n in names if f"{base}.{n}" in mods] or [base]:
                if target in mods and target != name:
                    targets.add(target)
        edges[name] = targets
    return edges


def test_no_import_circles():
    edges = graph(modules())
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    cycles = []

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_module_imports_another_modules_private_names():
    mods = modules()
    found = []
    for name, (path, tree) in mods.items():
        for base, names in imports(name, path, tree):
            if not base.startswith("kt_serve"):
                continue
            for n in names:
                private = n.startswith("_") and f"{base}.{n}" not in mods  # a private module is a name too
                extension = n == "_kernel" and base == "kt_serve" and name.startswith("kt_serve.kernel")
                if (private or f"{base}.{n}" == "kt_serve._kernel") and not extension:
                    found.append(f"{name} imports {base}.{n}")
    assert not found, found


def test_sglang_internals_only_in_the_plugin():
    found = [name for name, (path, tree) in modules().items() if not name.startswith("kt_serve.sglang_plugin")
             and any(base.startswith(("sglang.srt", "sglang.kernels")) for base, _ in imports(name, path, tree))]
    assert not found, found


def test_files_stay_readable_in_one_sitting():
    long = {name: n for name, (path, _) in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long
