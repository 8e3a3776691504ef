"""Packaging and layering rules from design §2 and the project card."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parent.parent


def test_ledger_never_imports_api() -> None:
    """The domain package imports neither the web layer nor the simulated engine."""
    offenders = []
    for path in (ROOT / "ledger").rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            offenders += [
                f"{path.relative_to(ROOT)}: {n}"
                for n in names
                if n.split(".")[0] in {"api", "rollout_sim"}
            ]
    assert offenders == []


def test_packaging_matches_the_design_card() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["name"] == "rollout-ledger"
    assert meta["requires-python"] == ">=3.11"
    assert "rollout-ledger" in meta["scripts"]
    for path in ("ledger", "api", "migrations", "tests", "alembic.ini", "README.md", ".ci/run"):
        assert (ROOT / path).exists(), path


def test_public_names_are_exactly_all() -> None:
    import ledger.codec
    import ledger.conformance
    import ledger.errors
    import ledger.gym

    for module in (ledger.errors, ledger.codec, ledger.conformance, ledger.gym):
        public = {n for n in vars(module) if not n.startswith("_")}
        exported = set(module.__all__)
        assert exported <= public, module.__name__
        defined_here = {
            n
            for n in public
            if getattr(getattr(module, n), "__module__", None) == module.__name__
            and (isinstance(getattr(module, n), type) or callable(getattr(module, n)))
        }
        assert defined_here <= exported | {"Factory"}, (module.__name__, defined_here - exported)


def test_demo_runs_the_whole_lifecycle_and_says_it_is_simulated(tmp_path: Path) -> None:
    from api.cli import app

    db = f"sqlite+aiosqlite:///{tmp_path / 'demo.db'}"
    res = CliRunner().invoke(app, ["demo", "--db", db], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "SIMULATED" in res.output
    assert "rollout-ledger serve --upstream" in res.output
    assert "delivered" in res.output and "get_weather" in res.output


def _imported_modules(path: Path) -> list[str]:
    """Absolute names of every module `path` imports, function-level imports included."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _eager_imports(path: Path) -> list[str]:
    """Absolute names of the modules `path` imports when it is loaded (outside functions)."""
    names: list[str] = []
    pending: list[ast.AST] = [ast.parse(path.read_text(), filename=str(path))]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        pending.extend(ast.iter_child_nodes(node))
    return names


def test_simulated_engine_stands_outside_the_product() -> None:
    """`rollout_sim` is test and demo support: the domain never imports it (see above); in the
    web layer only the demo module loads it eagerly, and the demo module itself (like any other
    sim command) is loaded only when its command runs."""
    assert not (ROOT / "ledger" / "sim").exists()
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "rollout_sim*" in packages["packages"]["find"]["include"]
    eager_sim_users = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "api").rglob("*.py")
        if any(n.split(".")[0] == "rollout_sim" for n in _eager_imports(path))
    )
    assert eager_sim_users == ["api/demo.py"]
    eager_demo_users = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "api").rglob("*.py")
        if "api.demo" in _eager_imports(path)
    ]
    assert eager_demo_users == []
    sim_imports = {
        n.split(".")[0]
        for path in (ROOT / "rollout_sim").rglob("*.py")
        for n in _imported_modules(path)
    }
    assert not sim_imports & {"ledger", "api"}


def test_serving_never_loads_the_simulated_engine() -> None:
    """Importing the service and the CLI (what `rollout-ledger serve` runs) loads no simulator."""
    probe = (
        "import sys, ledger, ledger.gym, ledger.delivery, api.app, api.cli, api.proxy\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'rollout_sim'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def _product_modules() -> dict[str, Path]:
    """Every module of ledger/ and api/ by dotted name (a package by its own name)."""
    modules: dict[str, Path] = {}
    for pkg in ("ledger", "api"):
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the product modules it imports, from every import statement anywhere in it
    (module level, inside functions, under ``TYPE_CHECKING``).

    ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``;
    an edge to a module's own enclosing package is left out (Python runs a package's
    ``__init__`` before any of its modules, so that is not a cycle between modules).
    """

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here[: len(here) - node.level + 1]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            else:
                continue
            for target in targets:
                found = owner(target)
                if found and found != module and not module.startswith(found + "."):
                    graph[module].add(found)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_among_product_modules() -> None:
    """No cycle among ledger/ and api/ modules, function-level imports included: a cycle hidden
    behind an import inside a function is still a cycle (issue 9)."""
    graph = _import_graph(_product_modules())
    assert graph["ledger.delivery"] >= {"ledger.store"}  # the graph sees real edges
    assert "ledger.delivery" not in graph["ledger.store"]
    assert _cycles(graph) == []


def test_cycle_finder_sees_a_function_level_cycle(tmp_path: Path) -> None:
    """The cycle test can fail: a cycle closed only by an import inside a function is found."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def late():\n    from pkg.a import thing\n    return thing\n")
    (pkg / "c.py").write_text("from . import a\n")
    modules = {
        "pkg": pkg / "__init__.py",
        "pkg.a": pkg / "a.py",
        "pkg.b": pkg / "b.py",
        "pkg.c": pkg / "c.py",
    }
    graph = _import_graph(modules)
    assert graph["pkg.c"] == {"pkg.a"}
    assert _cycles(graph) == [["pkg.a", "pkg.b"]]
