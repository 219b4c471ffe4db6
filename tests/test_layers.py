"""The layers of flodl hold by test: no import cycle, arrows that point one way, small modules.

Every module under ``flodl/`` is parsed (never imported) and each import in it, at any depth
(inside functions and ``if TYPE_CHECKING`` too), becomes an arrow of the import graph. An
import of ``pkg.name`` points at the module ``pkg.name`` when there is one, else at ``pkg``;
the parent packages Python imports on the way are not arrows (they hold no code that matters
here: each ``__init__`` is checked like any module).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

import flodl

PACKAGE = Path(flodl.__file__).parent

MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 400

# (package, packages it must not import). A package is a dotted prefix: "flodl.core" holds
# every module under flodl/core/.
FORBIDDEN = [
    ("flodl.core.common", ["flodl.core.cadence", "flodl.core.coordinator", "flodl.core.rank"]),
    ("flodl.core.cadence", ["flodl.core.coordinator", "flodl.core.rank"]),
    ("flodl.core.rank", ["flodl.core.coordinator", "flodl.core.cadence"]),
    ("flodl.core.coordinator", ["flodl.core.rank"]),
    ("flodl.wire", ["flodl.core", "flodl.transports", "flodl.worker", "flodl.coordinator"]),
    ("flodl.averaging", ["flodl.backends", "flodl.worker", "flodl.coordinator"]),
    ("flodl.supervise", ["flodl.coordinator", "flodl.launch", "flodl.observe", "flodl.worker"]),
    ("flodl.host", ["flodl.coordinator", "flodl.launch", "flodl.observe", "flodl.supervise"]),
    ("flodl.observe", ["flodl.launch", "flodl.supervise"]),
    ("flodl.coordinator", ["flodl.launch", "flodl.worker", "flodl.observe", "flodl.agent"]),
    # An agent runs on a host without the coordinator: it supervises, it does not train.
    ("flodl.agent", ["flodl.launch", "flodl.worker", "flodl.observe", "flodl.backends"]),
    ("flodl.worker", ["flodl.coordinator", "flodl.launch", "flodl.supervise", "flodl.observe"]),
    ("flodl.checkpoint", ["flodl.coordinator", "flodl.launch", "flodl.worker", "flodl.observe"]),
]

# What core may build on besides itself: nothing with I/O, no shell, no user config.
CORE_ALLOWED = ("flodl.core", "flodl.errors", "flodl.wire")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules_of(root: Path) -> dict[str, Path]:
    return {module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def imported_names(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, dotted name) of everything ``path`` imports, relative imports resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    modules = modules_of(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for _, dotted in imported_names(path, name):
            while dotted and dotted not in modules:
                dotted = dotted.rpartition(".")[0]
            if dotted and dotted != name:
                targets.add(dotted)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(f"{package}.")


def crossings(graph: dict[str, set[str]], package: str, banned: Iterable[str]) -> list[str]:
    banned = list(banned)
    return sorted(
        f"{source} -> {target}"
        for source, targets in graph.items()
        if within(source, package)
        for target in targets
        if any(within(target, other) for other in banned)
    )


GRAPH = import_graph(PACKAGE)


def test_the_graph_sees_the_package() -> None:
    assert len(GRAPH) > 100
    assert "flodl.core.coordinator.machine" in GRAPH["flodl.coordinator.server"]


def test_no_import_cycle_in_flodl() -> None:
    found = cycles(GRAPH)
    print(f"import cycles in flodl/: {len(found)}")
    assert found == []


@pytest.mark.parametrize(("package", "banned"), FORBIDDEN, ids=[p for p, _ in FORBIDDEN])
def test_package_does_not_import(package: str, banned: list[str]) -> None:
    assert any(within(name, package) for name in GRAPH), f"no module in {package}"
    assert crossings(GRAPH, package, banned) == []


CORE_MODULES = sorted(path for path in (PACKAGE / "core").rglob("*.py"))


@pytest.mark.parametrize("path", CORE_MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_core_imports_only_core_errors_and_wire(path: Path) -> None:
    name = module_name(path, PACKAGE)
    outside = [
        f"line {line}: {dotted}"
        for line, dotted in imported_names(path, name)
        if within(dotted, "flodl") and not any(within(dotted, ok) for ok in CORE_ALLOWED)
    ]
    assert not outside, f"{name} imports from outside {CORE_ALLOWED}: {outside}"


def test_every_core_package_states_its_rule() -> None:
    for init in sorted((PACKAGE / "core").rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "Rule:" in doc, f"{init.relative_to(PACKAGE)} states no rule"


def long_definitions(root: Path) -> list[str]:
    """Modules over MAX_MODULE_LINES lines and classes over MAX_CLASS_LINES, with sizes."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            found.append(f"module {path.relative_to(root.parent)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    found.append(f"class {path.relative_to(root.parent)}:{node.name}: {size} lines")
    return found


def test_no_long_module_or_class() -> None:
    assert long_definitions(PACKAGE) == []


# --- the checks themselves find what they must ----------------------------------------------


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_the_checks_see_a_cycle_a_crossing_and_a_long_module(tmp_path: Path) -> None:
    root = write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low/__init__.py": "",
            "pkg/low/a.py": "def f():\n    from pkg.high.b import g\n",
            "pkg/high/__init__.py": "",
            "pkg/high/b.py": "from ..low import a\nimport pkg.high.c\n",
            "pkg/high/c.py": "x = 1\n" * (MAX_MODULE_LINES + 1),
        },
    )
    graph = import_graph(root)
    assert graph["pkg.high.b"] == {"pkg.low.a", "pkg.high.c"}
    assert cycles(graph) == [["pkg.high.b", "pkg.low.a"]]
    assert crossings(graph, "pkg.low", ["pkg.high"]) == ["pkg.low.a -> pkg.high.b"]
    assert long_definitions(root) == [f"module pkg/high/c.py: {MAX_MODULE_LINES + 1} lines"]


def test_a_forbidden_core_import_is_seen(tmp_path: Path) -> None:
    module = tmp_path / "bad.py"
    module.write_text(
        "from flodl.core.common.policy import Policy\n"
        "def f():\n"
        "    from flodl.config import CoordinatorConfig\n"
        "import flodl.coordinator as c\n"
    )
    names = [
        dotted
        for _, dotted in imported_names(module, "flodl.core.bad")
        if not any(within(dotted, ok) for ok in CORE_ALLOWED)
    ]
    assert sorted(names) == ["flodl.config.CoordinatorConfig", "flodl.coordinator"]
