"""The import graphs of `jaxpar/` and `experiments/` have no circle.

Every import counts, those inside functions too: a function-local import that dodges a
circle is still the circle. Lazy imports of heavy or optional third-party modules (mpi4py,
TFDS) are outside both packages and do not show here.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxpar", "experiments")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The package modules `path` imports (`from a import b` counts a.b when b is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from a import b`: the module a.b when there is one, else a (b is a name in it)
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                     else node.module for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    modules = set(files)
    return {m: imports(p, modules) - {m} for m, p in files.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports as [a, b, ..., a], or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(edges.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_circle():
    cycle = find_cycle(graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_check_sees_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
