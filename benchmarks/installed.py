"""The package's bytecode, compiled as installing it does.

pip compiles every module of a wheel it installs (the Containerfile's image has them); a checkout
run with PYTHONDONTWRITEBYTECODE=1 (as the Containerfile and many CI machines set it) compiles the
whole package again at each start instead: ~0.1 s of every command measured at any size.
"""

from __future__ import annotations

import compileall
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compile_package() -> None:
    """Write the package's .pyc files where they are missing or stale (as `pip install` does)."""
    if not compileall.compile_dir(os.path.join(ROOT, "reconciler"), quiet=1):
        raise RuntimeError("compiling the package's bytecode failed")
