"""The house by concern, beyond what `lint-imports` checks in `make test` (pyproject.toml: layered packages, no
import cycles): no module imports another module's private name, and every objective the config accepts is in
the objective registry."""

import ast
from pathlib import Path

import pytest

from jaxllm.config.fine_tuning import OBJECTIVE_CHECKS, OBJECTIVES
from jaxllm.objectives.registry import OBJECTIVES as REGISTERED

ROOT = Path(__file__).resolve().parents[1]


def private_imports(source: str) -> list[tuple[int, str]]:
    """(line, name) of each `from jaxllm... import _name` in `source`."""
    return [(node.lineno, alias.name) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxllm")
            for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")]


def test_the_check_finds_a_private_import_at_any_depth():
    source = "def f():\n    from jaxllm.runs.checkpoint import Checkpointer, _array_registry\n"
    assert private_imports(source) == [(2, "_array_registry")]
    assert private_imports("from jaxllm.runs.checkpoint import Checkpointer\n") == []


@pytest.mark.smoke
def test_no_module_imports_a_private_name_of_another():
    files = sorted((ROOT / "jaxllm").rglob("*.py")) + sorted((ROOT / "scripts").rglob("*.py"))
    hits = [f"{f.relative_to(ROOT)}:{line} {name}" for f in files for line, name in private_imports(f.read_text())]
    assert hits == []


@pytest.mark.smoke
def test_every_objective_the_config_accepts_is_registered_and_checks_its_sections():
    assert set(REGISTERED) == set(OBJECTIVES) == set(OBJECTIVE_CHECKS)
