"""jaxpar/ and experiments/ stay a house a reader can hold, measured, not assumed: no class over
200 lines, no function over 60, no folder over 15 modules, one meaning per module-level name
within each package (a protocol several modules define alike is one meaning), and every import
inside a function says why it is there (a heavy or optional dependency; never a dodged circle,
which tests/test_imports.py would see anyway)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from conftest import ROOT

PACKAGES = (ROOT / "jaxpar", ROOT / "experiments")
MAX_CLASS_LINES, MAX_FUNCTION_LINES, MAX_MODULES = 200, 60, 15
PROTOCOL = {
    # experiments/: a study's STUDY, QUICK and run(config) (and a command's run(options), the
    # CLI's run(argv)); a tables module's TABLES and a figures module's FIGURES (publish/
    # collects them); a module's command-line entry main(argv); and the machinery of infra/:
    # missing() says why it cannot run here, up() and down().
    "experiments": {"STUDY", "QUICK", "run", "TABLES", "FIGURES", "main", "missing", "up", "down"},
    # jaxpar/: a rank entry's main(spec); a native module's C++ SOURCE, its built _library,
    # unavailable() (why not here) and Unavailable; a process tweak's state() for results; the
    # MLPs' EXPANSION; the tensor splits' block, leaf_spec and _varying (Megatron's and the
    # channel split's, alike); the library's front ends fit, benchmark and register_model (api),
    # which call the loop's, the benchmark's and the registry's of the same meaning.
    "jaxpar": {"main", "SOURCE", "_library", "unavailable", "Unavailable", "state", "EXPANSION",
               "block", "leaf_spec", "_varying", "fit", "benchmark", "register_model"},
}


def modules(package: Path | None = None) -> list[Path]:
    return sorted(p for pkg in ([package] if package else PACKAGES) for p in pkg.rglob("*.py"))


def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def where(path: Path, node: ast.AST) -> str:
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return f"{shown}:{node.lineno}"


def test_no_class_over_200_lines_and_no_function_over_60():
    long = []
    for path in modules():
        for node in ast.walk(parsed(path)):
            limit = (MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else
                     MAX_FUNCTION_LINES if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None)
            if limit and node.end_lineno - node.lineno + 1 > limit:
                long.append(f"{where(path, node)} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert long == []


def test_no_folder_holds_over_15_modules():
    counts = defaultdict(int)
    for path in modules():
        counts[path.parent.relative_to(ROOT)] += 1
    assert {str(folder): n for folder, n in counts.items() if n > MAX_MODULES} == {}


def module_names(tree: ast.Module) -> set[str]:
    """The names a module defines at its top level (functions, classes, assignments)."""
    found = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.Assign):
            found |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found.add(node.target.id)
    return found


def test_one_meaning_per_module_level_name():
    for package in PACKAGES:
        defined = defaultdict(list)
        for path in modules(package):
            for name in module_names(parsed(path)):
                if not name.startswith("__"):
                    defined[name].append(str(path.relative_to(ROOT)))
        twice = {name: paths for name, paths in defined.items()
                 if len(paths) > 1 and name not in PROTOCOL[package.name]}
        assert twice == {}, package.name


def unexplained_imports(path: Path) -> list[str]:
    """Imports inside functions with no comment on their line or on the lines right above them
    (comments and the imports beside it)."""
    lines = path.read_text().splitlines()
    found = []
    for func in ast.walk(parsed(path)):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            row = node.lineno - 1
            said = "#" in lines[row]
            while not said and row > func.lineno:
                row -= 1
                above = lines[row].strip()
                if not (above.startswith(("#", "import ", "from ")) and above):
                    break
                said = "#" in above
            if not said:
                found.append(f"{where(path, node)}: {lines[node.lineno - 1].strip()}")
    return found


def test_every_import_inside_a_function_says_why():
    assert [line for path in modules() for line in unexplained_imports(path)] == []


def test_the_checks_see_what_they_look_for(tmp_path):
    code = tmp_path / "m.py"
    code.write_text("def f():\n    import json\n\n\ndef g():\n    # heavy: only here\n    import json\n")
    assert len(unexplained_imports(code)) == 1
    assert module_names(ast.parse("A = 1\ndef f(): pass\nclass C: pass\nb: int = 2\n")) == {"A", "f", "C", "b"}


def test_test_modules_have_unique_names():
    # pytest imports each test file by its basename (tests/ has no packages): a second
    # test_x.py anywhere under tests/ is an import-file-mismatch error at collection
    seen: dict[str, Path] = {}
    for path in sorted(Path(__file__).parent.rglob("test_*.py")):
        assert path.name not in seen, f"{path} and {seen[path.name]} share a name: rename one"
        seen[path.name] = path
