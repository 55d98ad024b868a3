"""The offline GPU drivers (`capplan.offline`: calibrate, apply --smoke) stand apart from the
in-engine plugin and the launcher: they reach the plugin only through the engine processes
they start (CAPPLAN_PLAN in, CAPPLAN_REPORT out)."""

import ast
import importlib.util
from pathlib import Path

import pytest

OFFLINE = Path(__file__).resolve().parents[1] / "src" / "capplan" / "offline"
MODULES = sorted(OFFLINE.glob("*.py"))


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_the_offline_drivers_import_neither_the_plugin_nor_the_launcher(path):
    found = [n for n in _imports(path) if n.split(".")[:2] in (["capplan", "runtime"], ["capplan", "launcher"])]
    assert found == [], f"{path.name} imports {found}"


@pytest.mark.parametrize("module", ["capplan.offline.smoke", "capplan.offline.calibrate"])
def test_each_driver_starts_its_engines_as_its_own_module(module):
    path = OFFLINE / f"{module.rsplit('.', 1)[1]}.py"
    assert f'"{module}",' in path.read_text()  # the `python -m` its engine processes run
    assert importlib.util.find_spec(module) is not None
