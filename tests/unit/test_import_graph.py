"""The project's own modules import each other without a cycle, and the worker never imports
the benchmark: every import counts, also those inside functions, which hide a cycle from
Python until the function runs."""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path

import pytest

from tests.support.packaging import installed_names

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


INSTALLED_AS = installed_names(ROOT)
# The folders whose modules import each other; migrations are files Alembic loads by path.
PACKAGES = {folder: INSTALLED_AS[folder] for folder in ("jobsvc", "workers", "bench")}
WORKERS, BENCH = PACKAGES["workers"], PACKAGES["bench"]


def _module_name(path: Path, folder: Path, package: str) -> str:
    parts = (package, *path.relative_to(folder).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(f"{package}.")


def _imported_names(tree: ast.AST, module: str, is_package: bool,
                    modules: Collection[str]) -> Iterator[str]:
    """Every module an import statement anywhere in the tree asks for: for `from X import Y`,
    X.Y where Y is a submodule, else X. (A package's `__init__` that runs before its
    submodule is Python's doing, not an import the submodule's importer wrote.)"""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                yield submodule if submodule in modules else base


def import_graph(packages: Mapping[str, str] = PACKAGES,
                 root: Path = ROOT) -> dict[str, set[str]]:
    """The project's modules, each with the project's modules it imports; `packages` names
    the folders to read, each with the import package it installs as."""
    files = {_module_name(path, root / folder, package): path
             for folder, package in packages.items() for path in (root / folder).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        imported = _imported_names(tree, module, path.name == "__init__.py", files)
        graph[module] = {name for name in imported if name in files and name != module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules in order, the first repeated at the end), or None."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(module: str) -> list[str] | None:
        path.append(module)
        on_path.add(module)
        for imported in sorted(graph[module]):
            if imported in on_path:
                return [*path[path.index(imported):], imported]
            if imported not in done and (cycle := visit(imported)) is not None:
                return cycle
        on_path.discard(path.pop())
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done and (cycle := visit(module)) is not None:
            return cycle
    return None


def test_the_projects_modules_import_each_other_without_a_cycle() -> None:
    graph = import_graph()
    assert {"jobsvc.client", "jobsvc.workers.celery_app", "jobsvc.bench.probes"} <= set(graph)
    assert find_cycle(graph) is None


def test_no_worker_module_imports_the_benchmark() -> None:
    graph = import_graph()
    reaching = {module: sorted(name for name in imported if _within(name, BENCH))
                for module, imported in graph.items() if _within(module, WORKERS)}
    assert {module: names for module, names in reaching.items() if names} == {}


def _absolute_imports(path: Path) -> list[str]:
    """Every module a file names in an absolute import, wherever the import sits."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names]
    return names + [node.module for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and not node.level and node.module]


def test_no_module_imports_a_package_folder_by_the_folders_name() -> None:
    """From the repository root `import workers` finds the folder, but the wheel installs
    it as `jobsvc.workers` only: such an import works in a checkout and nowhere else."""
    renamed = {folder for folder, package in INSTALLED_AS.items() if folder != package}
    offenders: dict[str, list[str]] = {}
    for folder in (*INSTALLED_AS, "tests", "ops"):
        for path in (ROOT / folder).rglob("*.py"):
            if found := sorted(name for name in _absolute_imports(path)
                               if name.split(".")[0] in renamed):
                offenders[str(path.relative_to(ROOT))] = found
    assert offenders == {}


def test_tests_share_code_through_tests_support_only() -> None:
    """A test module imported by another runs its module-level code twice and hides where a
    helper lives: shared helpers belong in tests/support."""
    offenders: dict[str, list[str]] = {}
    for path in (ROOT / "tests").rglob("*.py"):
        if found := sorted(name for name in _absolute_imports(path)
                           if name.startswith("tests.") and not name.startswith("tests.support")):
            offenders[str(path.relative_to(ROOT))] = found
    assert offenders == {}


def test_the_cycle_finder_sees_a_cycle_through_an_import_inside_a_function(
        tmp_path: Path) -> None:
    package = tmp_path / "workers"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "app.py").write_text("from jobsvc.workers import control\n")
    (package / "control.py").write_text("def register():\n    from .app import run\n")
    graph = import_graph({"workers": "jobsvc.workers"}, tmp_path)
    assert graph["jobsvc.workers.app"] == {"jobsvc.workers.control"}
    assert find_cycle(graph) == [
        "jobsvc.workers.app", "jobsvc.workers.control", "jobsvc.workers.app"]
