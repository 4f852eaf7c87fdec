"""The checkout built as a wheel and installed into a directory of its own, as a user's
``pip install .`` elsewhere would be: what the wheel tests import from."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def install_wheel_elsewhere(tmp_path: Path) -> Path:
    """Build the wheel from a copy of the checkout and ``pip install --target`` it; return the
    target directory (put it first on ``PYTHONPATH``)."""
    root = Path(__file__).resolve().parents[1]
    src, wheels, site = tmp_path / "src", tmp_path / "wheels", tmp_path / "site"
    skip = shutil.ignore_patterns(".*", "build", "runs", "collected", "*.egg-info", "__pycache__")
    shutil.copytree(root, src, symlinks=True, ignore=skip)  # building writes beside the sources
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    done = subprocess.run([*build, "-w", str(wheels), str(src)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = wheels.glob("uag-*.whl")
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site)]
    done = subprocess.run([*install, str(wheel)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return site
