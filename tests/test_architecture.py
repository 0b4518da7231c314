"""The house of layers (README, "Repository") as import-linter checks it, and what the checker cannot see."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "omni_lightning"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def test_no_module_is_imported_by_name_at_run_time() -> None:
    """import-linter reads import statements; a module loaded through importlib or ``__import__`` would slip past
    the contracts (``importlib.util.find_spec``, which only asks whether an optional package exists, is fine)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                if name in ("__import__", "import_module", "importlib.import_module", "importlib.__import__"):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    assert not offenders, offenders


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "pyproject.toml"], cwd=tree, capture_output=True,
                          text=True, env={"PYTHONPATH": str(tree), "PATH": ""}, timeout=120)


@pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is not installed (pip install -e '.[dev]')")
@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        ("batch.py", "import lightning", "Nothing below the Lightning skins imports Lightning"),
        ("balance/cost.py", "import omni_lightning.parallel.layout", "Layers"),
        ("runtime/items.py", "import omni_lightning.data.packing", "Layers"),
        ("parallel/dims.py", "import omni_lightning.parallel.layout", "No import cycles"),
    ],
    ids=["lightning_below_the_skins", "planning_imports_a_primitive", "runtime_imports_data", "cycle_in_parallel"],
)
def test_the_contracts_hold_and_catch_a_broken_layer(tmp_path: Path, module: str, line: str, broken: str) -> None:
    tree = tmp_path / "tree"
    shutil.copytree(PACKAGE, tree / "omni_lightning", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tree)
    assert _lint(tree).returncode == 0, "the contracts of pyproject.toml are broken on main"
    target = tree / "omni_lightning" / module
    target.write_text(target.read_text() + f"\n{line}  # noqa\n")
    result = _lint(tree)
    assert result.returncode != 0
    assert f"{broken}" in result.stdout and "BROKEN" in result.stdout, result.stdout
