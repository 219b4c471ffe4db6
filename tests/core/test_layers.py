"""The layer arrows point one way: nothing in flodl/core imports a shell or the user config.

Each module under flodl/core is parsed (not imported) and every import in it, at any depth
(inside functions and ``if TYPE_CHECKING`` too), must name the standard library, a third-party
package, or one of the flodl packages core may build on.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import flodl.core

CORE = Path(flodl.core.__file__).parent
ALLOWED = ("flodl.core", "flodl.errors", "flodl.wire")


def flodl_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import of a flodl module in ``path``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: inside flodl.core by construction
                continue
            module = node.module or ""
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    flodl = [(line, name) for line, name in found if name == "flodl" or name.startswith("flodl.")]
    return sorted(flodl)


def allowed(name: str) -> bool:
    return any(name == package or name.startswith(f"{package}.") for package in ALLOWED)


MODULES = sorted(CORE.rglob("*.py"))


def test_core_has_modules_to_check() -> None:
    assert len(MODULES) > 10


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(CORE)))
def test_core_imports_only_core_errors_and_wire(path: Path) -> None:
    outside = [f"line {line}: {name}" for line, name in flodl_imports(path) if not allowed(name)]
    assert not outside, f"{path.name} imports from outside {ALLOWED}: {outside}"


def test_the_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    module = tmp_path / "bad.py"
    module.write_text(
        "from flodl.core.cycle import Policy\n"
        "def f():\n"
        "    from flodl.config import CoordinatorConfig\n"
        "import flodl.coordinator as c\n"
    )
    names = [name for _, name in flodl_imports(module) if not allowed(name)]
    assert names == ["flodl.config.CoordinatorConfig", "flodl.coordinator"]
