"""The package layout is the architecture (docs/architecture.md): imports run one way, from
the CLI down to devices and the state on disk. A module may import its own package and the
packages ranked below it, never one ranked above or beside it (two packages of one rank know
nothing of each other). Every import counts, also those inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

DRIVER = REPO / "driver"

# Lowest first: (rank, layer, the module prefixes in it). A module belongs to the layer of
# the longest prefix that names it; modules of one layer may import each other.
RANKS: list[tuple[int, str, tuple[str, ...]]] = [
    # the instruments every layer uses
    (0, "driver", ("driver", "driver._proto", "driver.logs", "driver.metrics", "driver.aio")),
    (1, "driver.kube", ("driver.kube",)),
    (2, "driver.devices", ("driver.devices",)),
    (3, "driver.state", ("driver.state",)),
    (4, "driver.publish", ("driver.publish",)),
    (4, "driver.scheduling", ("driver.scheduling",)),
    (5, "driver.prepare", ("driver.prepare",)),
    (6, "driver.monitoring", ("driver.monitoring",)),
    (7, "driver.kubelet", ("driver.kubelet",)),
    (7, "driver.nri", ("driver.nri",)),
    (8, "driver.sim", ("driver.sim",)),
    (8, "driver.service", ("driver.service",)),
    (9, "driver.demo", ("driver.demo",)),
    (10, "driver.explain", ("driver.explain",)),
    (11, "driver.cli", ("driver.cli", "driver.__main__")),
]


def owner(module: str) -> tuple[int, str]:
    """(rank, package) of a dotted module name."""
    best: tuple[int, str, str] | None = None
    for rank, layer, prefixes in RANKS:
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > len(best[2]):
                    best = (rank, layer, prefix)
    assert best is not None, f"{module}: in no layer of tests/test_layers.py"
    return best[:2]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of ours in a file, relative ones resolved."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                # `from driver.x import y`: y may be a module of its own
                sub = f"{target}.{alias.name}"
                as_module = (REPO / (sub.replace(".", "/") + ".py")).exists() or (
                    REPO / sub.replace(".", "/")).is_dir()
                found.append((node.lineno, sub if as_module else target))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names)
    return [(line, m) for line, m in found if m == "driver" or m.startswith("driver.")]


def sources() -> list[Path]:
    return sorted(p for p in DRIVER.rglob("*.py") if "_proto" not in p.parts)


def test_every_module_has_a_layer():
    for path in sources():
        owner(module_name(path))


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(DRIVER)))
def test_imports_run_down(path: Path):
    rank, package = owner(module_name(path))
    upward = []
    for line, target in imports(path):
        their_rank, their_package = owner(target)
        if their_package == package:
            continue
        if their_rank >= rank:
            upward.append(f"{path.relative_to(REPO)}:{line} imports {target} "
                          f"({their_package}, rank {their_rank}; own {package}, rank {rank})")
    assert not upward, "imports that do not run down:\n" + "\n".join(upward)


def test_the_checker_sees_an_upward_import(tmp_path: Path):
    """The check itself: a module of devices importing the prepare side is caught."""
    rank, package = owner("driver.devices.nvlibs")
    their_rank, _ = owner("driver.prepare.cdi")
    assert their_rank > rank
    assert owner("driver.service.plugin") == (8, "driver.service")
    assert owner("driver.monitoring.utilization.idle") == (6, "driver.monitoring")


def test_the_top_of_the_package_shows_only_the_entry_points_and_instruments():
    """driver/ itself holds the CLI and the instruments every layer uses; the run-time
    wiring lives in driver/service/ (issue 40: 12 top-level modules were too many to read)."""
    top = sorted(p.name for p in DRIVER.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(top) <= 8, top


def test_package_docstrings_say_what_they_own():
    for init in sorted(DRIVER.glob("*/__init__.py")):
        if init.parent.name == "_proto":
            continue
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.split()) >= 15, f"{init.relative_to(REPO)}: no docstring of what it owns"


def test_no_module_imports_itself_back():
    """Inside a package too, imports run one way: a cycle (a imports b imports a), even
    through an import inside a function, means two modules that are one concern or a
    dependency pointing the wrong way."""
    graph = {module_name(p): {m for _, m in imports(p)} for p in sources()}
    cycles = []
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph or nxt == node:
                continue
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
