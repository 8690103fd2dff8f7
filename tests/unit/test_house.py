"""The house rules of the product code, checked statically: every module is named in docs/ARCHITECTURE.md, no
import cycles, no long functions, a small distributed/ top level, and no lab-notebook history in code."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Repository folder -> the package it is installed as (pyproject.toml's package-dir).
PACKAGE_DIRS = {"peerline": "peerline", "distributed": "peerline.distributed", "kernels": "peerline.kernels",
                "models": "peerline.models", "launch": "peerline.launch", "bench": "peerline.bench"}
PRODUCT_DIRS = ("peerline", "distributed", "kernels", "models")
PRODUCT_FILES = ("launch/pipeline.py", "launch/cli.py")
MAX_FUNCTION_LINES = 60
MAX_TOP_LEVEL_MODULES = 12


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO)
    dotted = PACKAGE_DIRS[rel.parts[0]]
    rest = [p for p in rel.with_suffix("").parts[1:] if p != "__init__"]
    return ".".join([dotted, *rest])


def product_files() -> list[Path]:
    files = [p for d in PRODUCT_DIRS for p in sorted((REPO / d).rglob("*.py"))]
    return files + [REPO / f for f in PRODUCT_FILES]


def all_package_files() -> list[Path]:
    return [p for d in PACKAGE_DIRS for p in sorted((REPO / d).rglob("*.py"))]


def imports_of(path: Path) -> set[str]:
    """Every peerline module this file imports, at the top or inside a function."""
    tree = ast.parse(path.read_text())
    package = module_name(path)
    if path.name != "__init__.py":
        package = package.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m.startswith("peerline")}


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in all_package_files()}
    graph = {}
    for name, path in modules.items():
        graph[name] = {m for m in imports_of(path) if m in modules and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            # A package's __init__ importing its own sub-module is not a cycle worth reporting.
            if state.get(nxt) == 1 and not node.startswith(nxt + "."):
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_no_import_cycles() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_find_cycle_sees_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_product_never_imports_the_benchmarks() -> None:
    offenders = [f"{p.relative_to(REPO)} imports {m}" for p in product_files() for m in imports_of(p)
                 if m.startswith("peerline.bench")]
    assert not offenders, offenders


@pytest.mark.parametrize("path", product_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_functions_are_short(path: Path) -> None:
    long = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            first = min([d.lineno for d in node.decorator_list] + [node.lineno])
            if node.end_lineno - first + 1 > MAX_FUNCTION_LINES:
                long.append(f"{node.name} ({node.end_lineno - first + 1} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_distributed_top_level_is_small() -> None:
    top = [p.name for p in (REPO / "distributed").glob("*.py") if p.name != "__init__.py"]
    assert len(top) <= MAX_TOP_LEVEL_MODULES, sorted(top)


# History belongs in docs/benchmarks: dates, session / run / call numbers, issue numbers.
HISTORY = re.compile(r"\b20\d\d-\d\d-\d\d\b|\bcall \d+\b|\bcalls \d+|\bs\d-call\d|\b(first|second|third|fourth|fifth|"
                     r"sixth) session\b|\bsession \d+\b|\bissue #?\d+\b|(?<![\w/&])#\d{1,4}\b", re.IGNORECASE)


@pytest.mark.parametrize("path", [p for p in product_files()] + sorted((REPO / "kernels").glob("*.cu*")),
                         ids=lambda p: str(p.relative_to(REPO)))
def test_no_history_in_product_code(path: Path) -> None:
    hits = [f"{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1)
            if HISTORY.search(line) and "pytorch/pytorch#" not in line and "NVIDIA/nccl#" not in line]
    assert not hits, hits


def test_history_pattern() -> None:
    assert HISTORY.search("Seen on 2 x H200 (2026-11-26)")
    assert HISTORY.search("the s5-call5 sweep")
    assert HISTORY.search("measured in call 4")
    assert HISTORY.search("as issue #11 asked")
    assert not HISTORY.search("one call per flag operation")
    assert not HISTORY.search('"other": "#937860"')


def test_every_module_is_in_the_architecture_doc() -> None:
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    missing = []
    for path in all_package_files():
        rel = path.relative_to(REPO)
        if path.name == "__init__.py":
            continue
        # Named by its path from the repository root (distributed/p2p/ipc.py), from its top folder (p2p/ipc.py), or
        # by its file name alone in a listing of its folder.
        names = (str(rel), "/".join(rel.parts[1:]))
        if not any(n in text for n in names) and not re.search(rf"(?<![\w/]){re.escape(path.name)}\b", text):
            missing.append(str(rel))
    assert not missing, f"modules missing from docs/ARCHITECTURE.md: {missing}"
