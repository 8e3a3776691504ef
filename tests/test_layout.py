"""Packaging and layering rules from design §2 and the project card."""

from __future__ import annotations

import ast
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


def test_simulated_engine_stands_outside_the_product() -> None:
    """`rollout_sim` is test and demo support: the domain never imports it, and the web layer
    only in the demo module, which the CLI loads lazily for `rollout-ledger demo`."""
    assert not (ROOT / "ledger" / "sim").exists()
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "rollout_sim*" in packages["packages"]["find"]["include"]
    users = sorted(
        str(path.relative_to(ROOT))
        for pkg in ("ledger", "api")
        for path in (ROOT / pkg).rglob("*.py")
        if any(n.split(".")[0] == "rollout_sim" for n in _imported_modules(path))
    )
    assert users == ["api/demo.py"]
    top_level_demo_importers = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "api").rglob("*.py")
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.ImportFrom | ast.Import)
        and any(
            n == "api.demo"
            for n in (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            )
        )
    ]
    assert top_level_demo_importers == []
    sim_imports = {
        n.split(".")[0]
        for path in (ROOT / "rollout_sim").rglob("*.py")
        for n in _imported_modules(path)
    }
    assert not sim_imports & {"ledger", "api"}
