"""The import-floor check (``lint-imports``, configured in pyproject.toml) passes on the code as it
is and fails once an upward import or a cycle is added: run on a copy of the three packages (and
scripts/), so the check that CI runs is shown to catch what it is there for."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _copy(tmp_path: Path) -> Path:
    """The Python sources of uag, controllers, training and scripts, and pyproject.toml, under
    tmp_path."""
    for package in ("uag", "controllers", "training", "scripts"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=_not_python)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _not_python(directory: str, names: list[str]) -> set[str]:
    return {n for n in names if not n.endswith(".py") and not (Path(directory) / n).is_dir()}


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    # The copy first on the path: grimp must read these files, not the installed checkout.
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_floors_hold_on_the_code_as_it_is(tmp_path):
    result = _lint(_copy(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert " 0 broken" in result.stdout, result.stdout


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        # A climb that also closes a cycle: uag.api imports uag.runtime.models.
        ("uag/runtime/models.py", "import uag.api", "uag.runtime is not allowed to import uag.api"),
        # A cycle inside one floor, no climb between floors: prepared imports lean.
        (
            "uag/runtime/lean.py",
            "import uag.runtime.prepared",
            "No cycles are allowed in uag.runtime",
        ),
        # Training reaching up into the harness (what training/data.py once did).
        ("training/data.py", "import uag.harness.collect", "training is not allowed to import"),
        # The package reaching into the one-off scripts outside the wheel.
        ("uag/api.py", "import scripts.floor", "uag is not allowed to import scripts"),
    ],
)
def test_an_added_upward_import_or_cycle_fails_the_check(tmp_path, module, line, broken):
    root = _copy(tmp_path)
    with (root / module).open("a") as f:
        f.write(f"\n{line}  # injected by the test\n")
    result = _lint(root)
    assert result.returncode != 0, result.stdout
    assert broken in result.stdout, result.stdout
