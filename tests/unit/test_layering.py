"""The benchmarks stay out of the product's import path: the main job imports no peerline.bench module, and no
product file (distributed/, kernels/, peerline/, launch/pipeline.py, launch/cli.py) names one in an import."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]
BENCH = "peerline.bench"


def product_files() -> list[Path]:
    """Every Python file of the product: what `import peerline.launch.pipeline` may reach."""
    files = [p for folder in ("distributed", "kernels", "peerline") for p in sorted((REPO / folder).rglob("*.py"))]
    return files + [REPO / "launch" / "pipeline.py", REPO / "launch" / "cli.py"]


def imported_names(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import in the tree, those inside functions included, and of every
    importlib.import_module / __import__ call with a literal name."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def _is_bench(module: str) -> bool:
    return module == BENCH or module.startswith(BENCH + ".")


def test_imported_names_sees_every_form():
    code = ("import peerline.bench.benchkit\nfrom peerline import bench\nfrom peerline.bench import suites\n"
            "def f():\n    import importlib\n    importlib.import_module('peerline.bench.suites.p2p')\n")
    lines = {line for line, name in imported_names(ast.parse(code)) if _is_bench(name)}
    assert lines == {1, 2, 3, 6}, lines
    assert not [n for _, n in imported_names(ast.parse("import peerline.benchmarks\nimport bench")) if _is_bench(n)]


def test_no_product_file_imports_the_benchmarks():
    files = product_files()
    assert len(files) > 20 and all(p.is_file() for p in files)
    offenders = [f"{p.relative_to(REPO)}:{line}: {name}" for p in files
                 for line, name in imported_names(ast.parse(p.read_text(), str(p))) if _is_bench(name)]
    assert not offenders, "product code imports benchmark modules:\n" + "\n".join(offenders)


def test_the_main_job_loads_no_benchmark_module():
    code = ("import sys\n"
            "import peerline.launch.pipeline\n"
            "assert 'peerline.launch.pipeline' in sys.modules\n"
            f"print('\\n'.join(sorted(m for m in sys.modules if m == {BENCH!r} or m.startswith({BENCH + '.'!r}))))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", "the main job imports benchmark modules:\n" + proc.stdout
